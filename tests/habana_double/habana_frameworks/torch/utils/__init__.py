"""TEST DOUBLE of ``habana_frameworks.torch.utils``."""
