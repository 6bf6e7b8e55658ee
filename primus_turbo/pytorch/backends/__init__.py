"""Per op family: the implementations that exist and when each can run.

This package is the only place that knows which implementation serves which inputs.
"""
