"""The object tier: blocks as objects of an S3-API store (AWS S3, Ceph RGW, MinIO, GCS interop), below host."""
