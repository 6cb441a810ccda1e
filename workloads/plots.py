"""A load run at a glance: offered load, per-request latency by class, and the windowed reward."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_run(record: dict, path: str | Path, title: str = "") -> Path:
    """Three panels over the run's time: arrivals and errors per second; TTFT and E2EL of each
    completed request, by QoS class; and the mean reward and SLO attainment over sliding windows."""
    requests = record["requests"]
    summary = record["summary"]
    arrivals = np.array([r["arrival_s"] for r in requests])
    span = max(1.0, float(arrivals.max()) if len(arrivals) else 1.0)
    fig, (load, latency, reward) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    bins = np.arange(0, np.ceil(span) + 1)
    load.hist(arrivals, bins=bins, color="0.6", label="sent")
    failed = [r["arrival_s"] for r in requests if r["error_kind"]]
    if failed:
        load.hist(failed, bins=bins, color="tab:red", label="errored")
    load.set_ylabel("requests / s")
    load.legend(loc="upper right")
    for cls in sorted({r["qos_class"] for r in requests}):
        done = [r for r in requests if r["qos_class"] == cls and not r["error_kind"]]
        t = [r["arrival_s"] for r in done]
        latency.scatter(t, [r["e2el_s"] for r in done], s=8, marker="o", label=f"{cls} E2EL")
        latency.scatter(t, [r["ttft_s"] for r in done], s=8, marker="x", label=f"{cls} TTFT")
    if any(not r["error_kind"] for r in requests):
        latency.set_yscale("log")
        latency.legend(loc="upper right", fontsize=8)
    else:  # a log scale with no points fails; say why the panel is empty instead
        latency.text(0.5, 0.5, "no request completed", ha="center", transform=latency.transAxes)
    latency.set_ylabel("seconds")
    window = summary["window"]
    ends = arrivals[window - 1 :] if len(arrivals) >= window else np.empty(0)
    if summary["mean_reward"] is not None:
        reward.plot(
            ends, summary["windows"]["mean_reward"], label=f"mean reward, last {window}", marker="."
        )
    reward.plot(
        ends, summary["windows"]["slo_attainment"], label=f"SLO met, last {window}", marker="."
    )
    reward.set_ylim(-0.05, 1.05)
    reward.set_xlabel("arrival time (s)")
    reward.legend(loc="lower left")
    fig.suptitle(title or record.get("arrivals", {}).get("description", "load run"))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
