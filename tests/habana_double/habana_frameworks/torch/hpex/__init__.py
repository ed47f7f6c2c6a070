"""TEST DOUBLE of ``habana_frameworks.torch.hpex``."""
