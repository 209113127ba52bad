"""OpenAI-compatible router: proxy, balancing, outlier ejection, retries, endpoint table."""
