"""Examples: caches written outside kvcert, with the adapters that certify them."""
