"""TEST DOUBLE (stand-in) of ``neural_compressor.torch``."""
