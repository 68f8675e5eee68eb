"""SGLang 0.5.23's L3 storage tier (docs/storage.md): the engine's own storage threads and backends, unpatched.

| module | owns |
|---|---|
| `stepped` | SGLang's four storage threads stepped by the harness, and the bridge they write through |
| `file_store` | the harness's view of SGLang's `file` backend (`HiCacheFile`): spec records in, page files out |
| `s3_store` | SGLang's `seaweedfs` backend (S3 through boto3) on moto's server on loopback, and the harness's view of its objects |
"""
