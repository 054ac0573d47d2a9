"""The CUDA backend: backend.py binds the Triton kernels (paged_attention.py, turboquant_attention.py,
turboquant_encode.py, moe_gemm.py; imported on first use, as they import triton) through attention.py
and experts.py; graphs.py captures decode steps, memory.py sizes the KV cache for gpu_memory_utilization."""
