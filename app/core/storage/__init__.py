"""Where bytes live: the object store protocol with its local and S3 backends (object_store), the storage
root with per-job work directories and artifact keys (root), and upload bytes (uploads)."""
