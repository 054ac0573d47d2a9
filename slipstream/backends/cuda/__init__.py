"""The CUDA backend (backend.py): plain torch on the GPU today; Triton kernels and CUDA graphs belong here."""
