"""The OpInfo battery: PyTorch's own op database run on pjrt against CPU (see battery/run_opinfo.py)."""
