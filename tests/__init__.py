"""The test suites and their shared support (``tests.support``), importable from the repository root."""
