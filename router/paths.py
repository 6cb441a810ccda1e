"""The client's network path, as the router models it: how long a request takes to reach the
server, and its tokens to reach the client.

One model, two uses:
- `PathModel.sample` draws one response's network times over a path of models.yaml's path mixes,
  for the simulator, so that the SLO is met or missed at the client;
- `expected_network` is what the router expects over a measured path (`PathEstimate`), to tell how
  much of a request's budget is left for the server.

It is analytic, for training speed: a few draws per request where the packet-level model
(real aioquic over `netsim.link`'s link, `experiments.path_delivery`) takes thousands of
events. Its mean delivery time is within 10% of that model's on the LAN, LTE and 3G paths of the
`mixed` mix; on the bad path it comes out 13% short (README), its tail of probe-timeout backoffs
lighter than aioquic's.

What it models is QUIC's loss recovery, as aioquic runs it, because that is where the time goes:
- a packet not lost arrives one way plus its serialisation later;
- the server writes each token's SSE event as its iteration ends, one packet each; a stream is
  delivered in order, so a token shows when every packet up to it has arrived;
- the congestion window (CUBIC's, as aioquic keeps it) holds the tokens back after a loss, and
  stays shut while the ACKs that would open it are lost;
- a lost packet that later packets follow is declared lost when their ACK comes back
  (RFC 9002's time threshold: 9/8 of an RTT after it was sent, at the earliest), and re-sent;
- a lost packet that nothing follows (the last token, with the end of the stream, or a request)
  waits for the probe timeout, whose probe re-sends one; the timeout doubles while the probe or
  its ACK is lost, and the probe's ACK shows the others missing;
- loss is i.i.d. or Gilbert-Elliott, as the link has it, each response on its own chain, and
  each direction on its own.
Left out: queueing behind other responses (each response is a client of its own), delayed ACKs,
and pacing.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from config.paths import PathEstimate
from config.schema import PathMix, PathSpec

TOKEN_BYTES = 242
"""One token's SSE event, as the server writes it for a chat stream (a chunk of `serving.api`'s
shape with a 32-hex id, `opt-6.7b` and a one-word delta is 242 bytes)."""
HEAD_BYTES = 120
"""A response's status and headers; a request's headers and JSON envelope besides its prompt."""
END_BYTES = 14
"""`data: [DONE]\\n\\n` after the last token."""
PROMPT_BYTES_PER_TOKEN = 4.0
"""Prompt text per token, as `workloads.generate` sizes it."""
PACKET_OVERHEAD = 60
"""UDP, IP and QUIC short-header bytes around a packet's frames."""
PACKET_PAYLOAD = 1150
"""Stream bytes a full QUIC packet carries (aioquic's 1,200-byte datagrams at the start)."""
MAX_ACK_DELAY_S = 0.025
"""QUIC's default max_ack_delay, part of every probe timeout."""
MAX_PACKET = 1200
"""aioquic's datagram size, in which its congestion window counts."""
INITIAL_WINDOW = 10 * MAX_PACKET
MIN_WINDOW = 2 * MAX_PACKET
CUBIC_GROWTH = 3 * (1 - 0.7) / (1 + 0.7)
"""Packets a window of ACKs adds to CUBIC's window in its TCP-friendly region, where a window of
a few packets stays (RFC 9438, with aioquic's 0.7 reduction)."""
TIME_THRESHOLD = 9 / 8
"""RFC 9002: a packet is lost once an ACK shows a later one, if it is this many RTTs old."""


class NetworkTime(NamedTuple):
    """One response's time on the network, from its client's sending."""

    uplink_s: float
    """Until the whole request is at the server."""
    first_s: float
    """From the server writing the first token to the client having it."""
    last_s: float
    """From the server writing the last token to the client having every token."""


def _one_way(rtt_s: float, rate_bps: float, size: int) -> float:
    return rtt_s / 2 + (size + PACKET_OVERHEAD) * 8 / rate_bps


def _pto(rtt_s: float, rttvar_s: float) -> float:
    """RFC 9002's probe timeout, as aioquic computes it for the application space."""
    return rtt_s + max(4 * rttvar_s, 0.001) + MAX_ACK_DELAY_S


def _recovery(rtt_s: float, gap_s: float | None, pto_s: float) -> float:
    """From a lost packet's sending to its re-sending: the next packet (`gap_s` later) is ACKed
    an RTT after it left, and the lost one is declared lost then, at 9/8 RTT at the earliest; with
    no next packet within a probe timeout, the probe re-sends it."""
    if gap_s is None or gap_s + rtt_s >= pto_s:
        return pto_s
    return max(gap_s + rtt_s, TIME_THRESHOLD * rtt_s)


class _Losses:
    """One direction's draws of its path's loss process: i.i.d., or a Gilbert-Elliott chain
    started from its stationary state at time 0 and stepped per slot."""

    def __init__(self, path: PathSpec, rng: np.random.Generator) -> None:
        self.path, self.rng = path, rng
        self._bad = np.zeros(0, dtype=bool)

    def lost(self, t: float) -> bool:
        return bool(self.lost_at(np.array([t]))[0])

    def lost_at(self, times: np.ndarray) -> np.ndarray:
        """Whether a packet sent at each of `times` is lost."""
        bursts = self.path.bursts
        if bursts is None:
            return self.rng.random(len(times)) < self.path.loss
        slots = np.maximum(0, (times / bursts.slot_s).astype(int))
        self._extend(int(slots.max(initial=0)) + 1)
        loss = np.where(self._bad[slots], bursts.bad_loss, bursts.good_loss)
        return self.rng.random(len(times)) < loss

    def _extend(self, slots: int) -> None:
        bursts = self.path.bursts
        assert bursts is not None
        have = len(self._bad)
        if have >= slots:
            return
        states = list(self._bad)
        if not states:
            share = bursts.bad_slots / (bursts.good_slots + bursts.bad_slots)
            states.append(bool(self.rng.random() < share))
        flips = self.rng.random(slots)
        for u in flips[len(states) : slots]:
            bad = states[-1]
            states.append(
                not bad if u < 1 / (bursts.bad_slots if bad else bursts.good_slots) else bad
            )
        self._bad = np.array(states, dtype=bool)


WARM_SAMPLES = 4
"""RTT samples each end of a client's connection has before its request: the handshake's, and a
few from earlier turns."""


def _rttvar(rtt_s: float, samples: int) -> float:
    """aioquic's RTT variation after `samples` samples over a path of steady delay: half the RTT
    at the first, then three quarters of it at each next (its other term, |min - latest|, stays
    near 0)."""
    return rtt_s / 2 * 0.75 ** max(0, samples - 1)


@dataclass(frozen=True)
class PathModel:
    """Network times over one path of a mix, drawn per response. Each response is a client of its
    own, on a connection whose handshake has just finished: its probe timeout starts long (the
    RTT variation is half the RTT) and shortens as ACKs come back."""

    path: PathSpec

    def sample(
        self,
        rng: np.random.Generator | None,
        prompt_tokens: int,
        first_s: float,
        last_s: float,
        tokens: int,
    ) -> NetworkTime:
        """One response's network times. `first_s` and `last_s`: when the server wrote its first
        and last tokens, from the request's arrival there; `tokens`: how many it wrote. `rng` may
        be None on a path without loss."""
        path = self.path
        rtt = path.rtt_s
        up_bytes = HEAD_BYTES + round(prompt_tokens * PROMPT_BYTES_PER_TOKEN)
        head = _one_way(rtt, path.rate_bps, TOKEN_BYTES + HEAD_BYTES)
        tail = _one_way(rtt, path.rate_bps, TOKEN_BYTES + END_BYTES)
        if path.mean_loss == 0 or rng is None:
            return NetworkTime(_one_way(rtt, path.rate_bps, up_bytes), head, tail)
        # The downlink's losses, and the uplink's (the request, and ACKs).
        losses, acks = _Losses(path, rng), _Losses(path, rng)
        # The request: its packets leave back to back at 0; a lost one is the tail, re-sent by
        # the probe.
        pto = _pto(rtt, _rttvar(rtt, WARM_SAMPLES))
        # aioquic paces them at the window per RTT: a burst of a quarter window, then one
        # packet each packet time.
        pace = MAX_PACKET * rtt / INITIAL_WINDOW
        burst = math.ceil(INITIAL_WINDOW / 4 / MAX_PACKET)
        uplink, leaves, left = 0.0, 0.0, up_bytes
        for k in itertools.count():
            if left <= 0:
                break
            size = min(left, PACKET_PAYLOAD)
            left -= size
            leaves = (
                max(leaves, (k - burst + 1) * pace) + (size + PACKET_OVERHEAD) * 8 / path.rate_bps
            )
            resent = self._delivered(leaves, acks.lost(leaves), acks, None, pto)
            uplink = max(uplink, resent + rtt / 2)
        # The tokens, written evenly spaced from `at`, leave as the congestion window lets them;
        # each ACKed an RTT after it left adds an RTT sample.
        step = (last_s - first_s) / (tokens - 1) if tokens > 1 else 0.0
        at = uplink + first_s
        pto = _pto(rtt, _rttvar(rtt, WARM_SAMPLES + tokens))
        sent, lost, back = self._departures(losses, acks, at, step, tokens, pto)

        def pto_at(k: int) -> float:
            acked = int(np.searchsorted(sent, sent[k] - rtt, side="right"))
            return _pto(rtt, _rttvar(rtt, WARM_SAMPLES + acked))

        gap = sent[1] - sent[0] if tokens > 1 else None
        first = self._delivered(sent[0], bool(lost[0]), losses, gap, pto_at(0)) - at + head
        start = uplink + last_s
        done = self._tail(losses, acks, sent, lost, back, pto_at(tokens - 1))
        return NetworkTime(uplink, first, done - start + tail)

    def _departures(
        self, losses: _Losses, acks: _Losses, at: float, step: float, tokens: int, pto: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """When each token's packet leaves the server, whether it is lost, and when its ACK
        comes back (inf: it or its ACK was lost). Written `step` apart from `at`, each waits
        until the congestion window has room, as aioquic's CUBIC keeps it: 10 packets at first,
        growing by what is ACKed (slow start) or by half a packet per window ACKed (CUBIC's
        TCP-friendly growth); at a loss, cut to 0.7 of the bytes in flight (at least 2 packets),
        once per round trip. A stream of tokens has little in flight, so a loss cuts it to its
        minimum, which on a long path is below the stream's own rate: its tokens then queue.

        A packet leaves the flight when an ACK that covers it comes back: its own, or, if that
        was lost, a later one's (ACKs carry ranges); a lost packet, once such an ACK shows the
        gap, 9/8 RTT after it left at the earliest. While a burst takes the ACKs, nothing leaves
        the flight and the window stays shut, until a later ACK gets through or the probe
        timeout's probe (re-sent after 1, 2, 4... timeouts while the probes or their ACKs are
        lost) brings one back."""
        rtt = self.path.rtt_s
        size = TOKEN_BYTES + PACKET_OVERHEAD
        cwnd, ssthresh = float(INITIAL_WINDOW), math.inf
        recovering_until = -math.inf
        sent = np.empty(tokens)
        lost = np.zeros(tokens, dtype=bool)
        back = np.full(tokens, math.inf)
        oldest = 0  # the oldest packet still in flight
        covered = -1  # the newest packet an ACK back by now covers
        seen = 0  # packets whose ACK time has been looked at
        reopened = -math.inf  # when a probe last brought an ACK back
        for k in range(tokens):
            now = at + k * step
            while True:
                while seen < k and sent[seen] + rtt <= now:
                    if back[seen] <= now:
                        covered = seen
                    seen += 1
                if reopened <= now:
                    covered = max(covered, seen - 1) if reopened > -math.inf else covered
                while oldest <= covered and (
                    not lost[oldest] or sent[oldest] + TIME_THRESHOLD * rtt <= now
                ):
                    if lost[oldest]:
                        if sent[oldest] > recovering_until:
                            cwnd = ssthresh = max(MIN_WINDOW, 0.7 * (k - oldest) * size)
                            recovering_until = now + rtt
                    elif cwnd < ssthresh:
                        cwnd += size
                    else:
                        cwnd += CUBIC_GROWTH * MAX_PACKET * size / cwnd
                    oldest += 1
                if (k - oldest + 1) * size <= cwnd:
                    break
                now = self._reopens(losses, acks, sent, back, oldest, k, now, pto)
                reopened = now
            sent[k] = now
            lost[k] = losses.lost(now)
            if not lost[k] and not acks.lost(now + rtt / 2):
                back[k] = now + rtt
        return sent, lost, back

    def _reopens(
        self, losses: _Losses, acks: _Losses, sent: np.ndarray, back: np.ndarray, oldest: int,
        k: int, now: float, pto: float,
    ) -> float:  # fmt: skip
        """When the shut window opens again: the next ACK of a packet in flight that comes
        back, else the first probe whose round trip gets through."""
        rtt = self.path.rtt_s
        waiting = back[oldest:k]
        coming = waiting[(waiting > now) & np.isfinite(waiting)]
        if len(coming):
            return float(coming.min())
        probe, timeout = float(sent[k - 1]), pto
        while True:
            probe = max(probe + timeout, now)
            if not losses.lost(probe) and not acks.lost(probe + rtt / 2):
                return probe + rtt
            timeout *= 2

    def _tail(
        self, losses: _Losses, acks: _Losses, sent: np.ndarray, lost: np.ndarray,
        back: np.ndarray, pto: float,
    ) -> float:  # fmt: skip
        """When the last of the tokens sent at `sent` leaves the server for good, less its
        one-way time, as aioquic recovers the lost ones:
        - one that a later packet's ACK shows missing (`back`), before the probe timeout after
          the last token, is re-sent then, 9/8 RTT after it left at the earliest;
        - the rest wait for the probe timeout, whose probe re-sends the oldest of them; once
          the probe's ACK comes back, the others are declared lost and re-sent. A probe that is
          lost, or whose ACK is, is sent again after twice the timeout;
        - a re-sent packet that is lost again waits for the next probe."""
        rtt = self.path.rtt_s
        start = float(sent[-1])
        if not lost.any():
            return start
        later = np.append(np.minimum.accumulate(back[::-1])[::-1][1:], np.inf)
        resend = np.maximum(later, sent + TIME_THRESHOLD * rtt)
        done, waiting = start, 0
        for at in resend[lost]:
            if at < start + pto and not losses.lost(at):
                done = max(done, at)
            else:
                waiting += 1
        last = start
        while waiting:
            # A probe after the timeout (doubling while no ACK comes back) carries one of them.
            timeout, probe = pto, last
            carried = False
            while True:
                probe += timeout
                if not carried and not losses.lost(probe):
                    carried = True
                    done, waiting = max(done, probe), waiting - 1
                if not waiting or (carried and not acks.lost(probe + rtt / 2)):
                    break
                timeout *= 2
            # Its ACK shows the rest missing: re-sent at once; those lost again wait on.
            last = probe + rtt
            for _ in range(waiting):
                if losses.lost(last):
                    continue
                done, waiting = max(done, last), waiting - 1
        return done

    def _delivered(
        self, sent: float, lost: bool, losses: _Losses, gap: float | None, pto: float
    ) -> float:
        """When a packet sent at `sent` leaves for good (its last re-sending), less its one-way
        time; `gap`: until the next packet after it (None: none follows)."""
        wait = _recovery(self.path.rtt_s, gap, pto)
        probe = pto
        while lost:
            sent += wait
            if wait >= probe:  # probes back off
                probe *= 2
                wait = probe
            lost = losses.lost(sent)
        return sent


def expected_network(
    estimate: PathEstimate, prompt_tokens: int, output_tokens: int, step_s: float
) -> NetworkTime:
    """The mean network times over a measured path, with i.i.d. loss at its measured rate, for a
    response whose tokens come `step_s` apart (the per-token SLO, as the budget assumes)."""
    return NetworkTime(*_expected(estimate, prompt_tokens, output_tokens, step_s))


_FIRST_BITS = (TOKEN_BYTES + HEAD_BYTES + PACKET_OVERHEAD) * 8
_LAST_BITS = (TOKEN_BYTES + END_BYTES + PACKET_OVERHEAD) * 8
_UP_BITS = (HEAD_BYTES + PACKET_OVERHEAD) * 8
_UP_BITS_PER_TOKEN = PROMPT_BYTES_PER_TOKEN * 8


def _expected(
    estimate: PathEstimate, prompt_tokens: int, tokens: int, step_s: float
) -> tuple[float, float, float]:
    """`expected_network` in closed form, as plain floats: the router computes it for every request
    it routes, within a decision's few tens of microseconds (a network-aware decision may cost at
    most 10 us more than a network-blind one at p99), so it is written out here rather than through
    the sampler's helpers, with the packet sizes folded into module constants."""
    rtt, rttvar, p, rate = estimate
    half = rtt / 2
    if rate:
        uplink = half + (_UP_BITS + prompt_tokens * _UP_BITS_PER_TOKEN) / rate
        first, last = half + _FIRST_BITS / rate, half + _LAST_BITS / rate
    else:
        uplink = first = last = half
    if not p:
        return uplink, first, last
    pto = rtt + (4 * rttvar if rttvar > 0.00025 else 0.001) + MAX_ACK_DELAY_S
    packets = -(-(HEAD_BYTES + prompt_tokens * PROMPT_BYTES_PER_TOKEN) // PACKET_PAYLOAD)
    uplink += (1 - (1 - p) ** packets) * pto
    if tokens > 1 and step_s > 0:
        # As `_recovery`: the next token's ACK shows the loss, unless the probe comes first.
        gap = step_s + rtt
        recovery = pto if gap >= pto else (gap if gap > TIME_THRESHOLD * rtt else 1.125 * rtt)
        # A lost packet k steps before the last holds it back by what its recovery outlasts
        # them: the sum over k = 1..K of (recovery - k step), K the last k it outlasts.
        k = int(recovery / step_s)
        if k > tokens - 1:
            k = tokens - 1
        return (
            uplink,
            first + p * recovery,
            last + p * (pto + k * recovery - step_s * k * (k + 1) / 2),
        )
    return uplink, first + p * pto, last + p * pto


class Budget(NamedTuple):
    """What is left of a request's time for the server, once the network has had its share."""

    first_token_s: float
    """Until its first token must be written, for it to reach the client by the class's
    deadline (which runs from arrival at the server)."""
    answer_s: float
    """Until its last token must be written, for the whole answer to reach the client within
    the SLO (which runs from the client's sending)."""


def budget(
    estimate: PathEstimate | None,
    deadline_s: float,
    tpot_s: float,
    output_tokens: int,
    prompt_tokens: int,
    elapsed_s: float = 0.0,
) -> Budget:
    """A request's remaining budget, `elapsed_s` after its arrival at the server, over the path
    `estimate` (None: nothing known of it, which costs nothing)."""
    tokens = max(1, output_tokens)
    first, answer = spent(estimate, prompt_tokens, tokens, tpot_s, elapsed_s)
    return Budget(deadline_s - first, tpot_s * tokens - answer)


def spent(
    estimate: PathEstimate | None,
    prompt_tokens: int,
    output_tokens: int,
    tpot_s: float,
    elapsed_s: float,
) -> tuple[float, float]:
    """What is gone of a request's first-token deadline and of its SLO's time, `elapsed_s` after
    its arrival at the server: that time, and what the network is expected to take of each (the
    first token's way down; the way up and the last token's way down)."""
    if estimate is None:
        return elapsed_s, elapsed_s
    uplink, first, last = _expected(estimate, prompt_tokens, output_tokens, tpot_s)
    return elapsed_s + first, elapsed_s + uplink + last


def estimate_of(path: PathSpec) -> PathEstimate:
    """What a server would measure of `path` over a warm connection: its RTT, the RTT variation
    after a few samples, its mean loss, its rate. The simulator's requests carry it, as live
    ones carry a measured one."""
    return PathEstimate(
        path.rtt_s, _rttvar(path.rtt_s, WARM_SAMPLES), path.mean_loss, path.rate_bps
    )


class PathDraw(NamedTuple):
    """A simulated request's path: its name in the mix, and a seed for its losses."""

    name: str
    seed: int


class ClientPaths:
    """Draws each simulated request's path from a mix, with a generator of its own, so that the
    workload's arrivals and contents are the same with paths as without."""

    def __init__(self, mix: PathMix, seed: int) -> None:
        self.names = list(mix.paths)
        self.models = {name: PathModel(spec) for name, spec in mix.paths.items()}
        self.estimates = {name: estimate_of(spec) for name, spec in mix.paths.items()}
        shares = np.array([mix.paths[n].share for n in self.names], dtype=float)
        self._cumulative = np.cumsum(shares / shares.sum())
        self._rng = np.random.default_rng([seed, 17])

    def fork(self) -> ClientPaths:
        """A copy whose draws go on as this one's would, apart from it."""
        paths = copy.copy(self)
        paths._rng = copy.deepcopy(self._rng)
        return paths

    def draw(self) -> PathDraw:
        u, seed = self._rng.random(), int(self._rng.integers(2**63))
        index = min(int(np.searchsorted(self._cumulative, u, side="right")), len(self.names) - 1)
        return PathDraw(self.names[index], seed)

    def sample(
        self, draw: PathDraw, prompt_tokens: int, first_s: float, last_s: float, tokens: int
    ) -> NetworkTime:
        model = self.models[draw.name]
        rng = np.random.default_rng(draw.seed) if model.path.mean_loss > 0 else None
        return model.sample(rng, prompt_tokens, first_s, last_s, tokens)
