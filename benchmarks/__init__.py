"""Benchmarks of primus-turbo ops against their vendor-library peers (see README.md)."""
