"""CPU capability detection and tokenmill's C++ CPU kernels (built on first use, chosen at run time)."""
