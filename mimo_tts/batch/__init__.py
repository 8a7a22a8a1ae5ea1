"""Batch jobs: many items -> files, resumable (items, runner, sinks, files, shards, status, Ray)."""
