"""Packs at URLs (s3://, gs://, https://): the fsspec store, the download cache, uploads."""
