"""Data shipped with torch_pjrt: the OpInfo coverage table (op_coverage.json) read by `torch-pjrt ops`."""
