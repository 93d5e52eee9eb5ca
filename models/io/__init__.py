"""Reading what a user names, bounded: model loading (loading), GGUF conversion (converted) and header
reading (gguf_header), packaged assets (assets), bounded JSON (bounded_json), limited child processes
(sandbox), atomic writes (atomic), sizes and ids.
"""
