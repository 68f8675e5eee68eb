"""tinycache: an example third-party prefix KV cache and its kvcert adapter."""
