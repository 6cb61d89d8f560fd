"""The `torch-pjrt` command line: info, scan, run, bench (and ops)."""
