"""Rank 0's engine (requests, continuous batching, KV block accounting, sampling) and every rank's start-up."""
