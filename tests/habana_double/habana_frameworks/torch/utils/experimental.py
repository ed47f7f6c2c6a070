"""TEST DOUBLE of ``habana_frameworks.torch.utils.experimental``: which Gaudi this is.

Intel Neural Compressor and optimum-habana ask ``_get_device_type() == synDeviceType.synDeviceGaudi2`` to pick the
fp8 range (Gaudi2: e4m3 up to 240; Gaudi3: 448). The double answers from ``HABANA_DOUBLE_DEVICE`` (``gaudi2``, the
default, or ``gaudi3``), read at each call so a test can switch devices; the real bridge asks the driver.
"""

import enum
import os


class synDeviceType(enum.IntEnum):  # noqa: N801 - Habana's name
    synDeviceGaudi = 1
    synDeviceGaudi2 = 2
    synDeviceGaudi3 = 3


_NAMES = {"gaudi": synDeviceType.synDeviceGaudi, "gaudi2": synDeviceType.synDeviceGaudi2,
          "gaudi3": synDeviceType.synDeviceGaudi3}  # fmt: skip


def _get_device_type():
    name = os.environ.get("HABANA_DOUBLE_DEVICE", "gaudi2")
    if name not in _NAMES:
        raise ValueError(f"HABANA_DOUBLE_DEVICE={name!r}: one of {sorted(_NAMES)}")
    return _NAMES[name]
