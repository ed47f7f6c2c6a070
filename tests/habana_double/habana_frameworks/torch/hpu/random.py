"""TEST DOUBLE of ``habana_frameworks.torch.hpu.random``: the HPU's default generator, seeded as optimum-habana's
``set_seed`` seeds it (``torch.manual_seed(seed)`` then ``hpu.random.manual_seed_all(seed)``). torch has no
``torch.Generator(device="hpu")``: HPU ops draw from this default generator. The double's device computes on the
host, so its default generator is torch's CPU one; every seeding is recorded."""

import torch

from habana_frameworks import record


def manual_seed(seed):
    record("hpu.random.manual_seed", int(seed))
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed):
    record("hpu.random.manual_seed_all", int(seed))
    torch.default_generator.manual_seed(int(seed))


def initial_seed():
    return torch.default_generator.initial_seed()


def get_rng_state():
    return torch.default_generator.get_state()


def set_rng_state(state):
    torch.default_generator.set_state(state)
