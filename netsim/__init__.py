"""Link emulation for experiments and tests: one sans-IO link model (`link`: rate, queue, delay,
i.i.d. and Gilbert-Elliott loss, Mahimahi delivery traces), driven in virtual time between two
aioquic connections (`simlink`), as a live UDP relay (`relay`), and as a TUN forwarder between
network namespaces that carries kernel TCP and QUIC alike (`netem`, `forwarder`, `probe`; root).

It may import transport; transport, and serving, never import it."""
