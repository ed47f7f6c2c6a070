"""TEST DOUBLE of ``habana_frameworks.torch.hpu.metrics``: Habana's runtime metrics API for graph compilations.

``metric_global("graph_compilation").stats()`` returns ``[("TotalNumber", n), ("TotalTime", ms), ("AvgTime", ms)]``
as the real one does: n counts the graphs compiled in this process (``_device.py``: a lazy-mode graph the first time
its signature is seen, an HPU graph at capture, an eager op per new signature). Times are 0 in the double.
``metric_localcontext`` counts those inside its ``with`` block."""

from contextlib import contextmanager


NAMES = ("graph_compilation",)


class _Metric:
    def __init__(self, name, start=0):
        if name not in NAMES:
            raise ValueError(f"metric {name!r} is not modelled by the test double (only {NAMES})")
        self.name, self.start, self.end = name, start, None

    def stats(self):
        from habana_frameworks.torch import _device

        n = (_device.compilations() if self.end is None else self.end) - self.start
        return [("TotalNumber", n), ("TotalTime", 0), ("AvgTime", 0.0)]


def metric_global(name):
    return _Metric(name)


@contextmanager
def metric_localcontext(name):
    from habana_frameworks.torch import _device

    m = _Metric(name, _device.compilations())
    try:
        yield m
    finally:
        m.end = _device.compilations()
