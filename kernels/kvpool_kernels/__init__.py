"""kvpool attention and cache-copy kernels: flashinfer on CUDA, a torch reference elsewhere."""
