"""TEST DOUBLE (stand-in) of Intel Neural Compressor: only the torch fp8 entry points optimum-habana calls."""
