"""tf_agn.utils.devices: reading device names, and finding this process's."""

import pytest

from conftest import DEVICES
from tf_agn.utils import devices


@pytest.mark.parametrize(
    "name, device_type, local_name, host",
    [
        ("/job:worker/replica:0/task:1/device:GPU:2", "GPU", "GPU:2", "/job:worker/replica:0/task:1/device:CPU:0"),
        ("/gpu:1", "GPU", "GPU:1", "/device:CPU:0"),
        ("cpu:3", "CPU", "CPU:3", "/device:CPU:0"),
        ("", "CPU", "CPU:0", "/device:CPU:0"),
    ],
)
def test_names_are_read_alike_everywhere(name, device_type, local_name, host):
    assert devices.device_type(name) == device_type
    assert devices.local_name(name) == local_name
    assert devices.host_of(name) == host


@pytest.mark.parametrize(
    "name, index",
    [("/cpu:2", 2), ("CPU:3", 3), ("cpu", 0), ("/job:localhost/device:CPU:1", 1), (DEVICES[1], 1)],
)
def test_resolve_gives_the_full_name_of_the_device_named(name, index):
    assert devices.resolve(name) == DEVICES[index]


@pytest.mark.parametrize("name", ["/cpu:9", "/gpu:0", "/job:worker/device:CPU:0"])
def test_resolve_names_the_bad_device_and_the_devices_there_are(name):
    with pytest.raises(ValueError, match=rf"reduce_to_device must name devices this process has \(.*CPU:3\); received '{name}'"):
        devices.resolve(name, "reduce_to_device")
