"""What the tests share besides fixtures: the tiers (`tiers`), servers to start and talk to
(`servers`), the processes under a server (`processes`) and a QUIC pair in memory (`quic`).
The fixtures and pytest's hooks stay in tests/conftest.py."""
