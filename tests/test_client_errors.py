"""The Python client's errors as an engine author meets them."""
import pytest

from moecache_client import Client, ClientError


def test_missing_ipc_socket_fails_at_once_with_one_line(tmp_path):
    sock = tmp_path / "moecached.sock"
    with pytest.raises(ClientError) as e:
        Client(f"ipc://{sock}", connect_timeout=1)
    assert str(e.value) == f"no daemon socket at {sock}: is moecached running? (systemctl status moecached)"
