"""The API's request and response models (pydantic): jobs and the spec (jobs), uploads and usage (uploads)."""
