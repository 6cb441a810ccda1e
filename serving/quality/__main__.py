"""`python -m serving.quality --deployment embedded`: each model's zero-shot accuracy on the
four tasks of Chuppala (2024), HellaSwag, COPA, PIQA and OpenBookQA, measured by lm-eval through
the server.

Every request pins one model ("model": "<name>") of a running server (--url), or of one this
command starts for the deployment and stops at the end. Writes the quality table (--out) and
prints it normalised to the best model of each task, beside the thesis's Table 1."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from config import (
    DEFAULT_PATH,
    ConfigError,
    ModelsFile,
    ReplicaConfig,
    load,
    load_deployment,
)
from config.quality import MeasuredQuality, Score
from serving.launch import NotReady, free_port, launch, serving_command
from serving.quality.evaluate import NUM_FEWSHOT, Sample
from serving.quality.table import ThesisRow, comparison
from serving.quality.tasks import FIXTURES, TASKS, data_file

STARTUP_TIMEOUT_S = 600.0
"""Three engines take 30-60 s to start on two cores; a hub model may first download."""


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.quality", description=__doc__)
    parser.add_argument("--config", default=str(DEFAULT_PATH), help="path to models.yaml")
    parser.add_argument("--deployment", help="a deployment of models.yaml (default: its default)")
    parser.add_argument(
        "--url",
        help="a running server of the deployment, e.g. http://127.0.0.1:8000 (default: start "
        "`python -m serving` for the deployment, with admission control off, and stop it after)",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="no server: lm-eval's own vllm backend on each model's files, in this process "
        "(the reference the server's numbers should match)",
    )
    parser.add_argument("--models", help="comma-separated (default: every model of the deployment)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of %(default)s")
    parser.add_argument("--limit", type=int, help="items per task (default: all)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=FIXTURES,
        help="one file per task, <task>.jsonl or .parquet (default: the ~20-item fixtures "
        "shipped in serving/quality/data; the README's 'Model quality' says where the full "
        "sets come from)",
    )
    parser.add_argument(
        "--out", type=Path, help="the table (default: results/quality/<deployment>.yaml)"
    )
    parser.add_argument("--samples", type=Path, help="also write each item's scores here (JSONL)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per request")
    parser.add_argument("--num-concurrent", type=int, default=2, help="requests in flight")
    parser.add_argument(
        "--qos-class",
        default="long",
        help="the x-qos-class of every request (default: long, whose deadline suits batches)",
    )
    parser.add_argument("--api-key", default=os.environ.get("QOS_API_KEY"),
                        help="sent as Authorization: Bearer (default: $QOS_API_KEY)")  # fmt: skip
    parser.add_argument("--port", type=int, help="for the server this starts (default: a free one)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        deployment = load_deployment(args.config, args.deployment)
        spec = load(args.config)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    tasks = _names(args.tasks, TASKS, "task", parser)
    models = _names(args.models, deployment.models, "model of the deployment", parser)
    if args.direct and args.url:
        parser.error("--direct evaluates without a server: leave --url out")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if deployment.simulation is not None:
        parser.error(f"{deployment.name} runs simulated engines: there is no model to measure")
    for task in tasks:
        try:
            data_file(args.data_dir, task)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    replicas = {m: next(r for r in deployment.replicas if r.model == m) for m in models}
    _offline(replicas.values())
    for replica in replicas.values():
        if replica.build is not None:  # a tiny model, built here on first use
            from serving.embedded import ensure_built

            ensure_built(replica.source, replica.build)

    # SIGTERM as an exception, so that the server this started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None and not args.direct:
            url = stack.enter_context(_server(args.config, deployment.name, args.port))
        scores, samples = _run(args, replicas, tasks, url)

    data = "fixtures" if args.data_dir.resolve() == FIXTURES else str(args.data_dir)
    command = shlex.join(["python", "-m", "serving.quality", *sys.argv[1:]])
    table = MeasuredQuality(
        command=command, date=datetime.date.today().isoformat(), deployment=deployment.name,
        data=data, num_fewshot=NUM_FEWSHOT, tasks=scores,
    )  # fmt: skip
    out = args.out or Path("results/quality") / f"{deployment.name}.yaml"
    table.write(out)
    if args.samples is not None:
        args.samples.parent.mkdir(parents=True, exist_ok=True)
        args.samples.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    rows = {m: _thesis_row(spec, m) for m in models}
    print(comparison(table, spec.quality.tasks, rows))
    print(f"\nseed: {spec.quality.source.strip()}")
    print(f"wrote {out}" + (f" and {args.samples}" if args.samples else ""))
    return 0


def _run(
    args: argparse.Namespace,
    replicas: dict[str, ReplicaConfig],
    tasks: list[str],
    url: str | None,
) -> tuple[dict[str, dict[str, Score]], list[Sample]]:
    # Imported here: lm-eval takes seconds to import, and --help and config errors need none.
    from lm_eval.tasks import TaskManager
    from tqdm import tqdm

    from serving.quality import evaluate

    scores: dict[str, dict[str, Score]] = {task: {} for task in tasks}
    samples: list[Sample] = []
    task_manager = TaskManager()  # indexes every task YAML lm-eval ships: once, not per run
    headers = {"x-qos-class": args.qos_class}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    progress = tqdm(total=len(replicas) * len(tasks), desc="quality", unit="task")
    for model, replica in replicas.items():
        max_model_len = replica.engine_int("max_model_len", 2048)
        if url is None:
            engine_args: dict[str, object] = {"dtype": "float32"} if replica.device == "cpu" else {}
            engine_args.update(replica.engine_args)
            kv_cache = int(replica.kv_cache_gib * 2**30) if replica.kv_cache_gib else None
            lm = evaluate.direct_vllm(
                replica.source,
                batch_size=args.batch_size,
                engine_args=engine_args,
                kv_cache_bytes=kv_cache,
            )
        else:
            lm = evaluate.through_server(
                url,
                model,
                replica.source,
                batch_size=args.batch_size,
                num_concurrent=args.num_concurrent,
                max_length=max_model_len,
                headers=headers,
            )
        try:
            for task in tasks:
                progress.set_postfix_str(f"{model} {task}")
                result = evaluate.evaluate(lm, model, task, args.data_dir, args.limit, task_manager)
                scores[task][model] = result.score
                samples.extend(result.samples)
                progress.update()
        finally:
            evaluate.shut_down(lm)
    progress.close()
    return scores, samples


def _names(given: str | None, known: list[str] | tuple[str, ...], what: str,
           parser: argparse.ArgumentParser) -> list[str]:  # fmt: skip
    names = [n.strip() for n in given.split(",") if n.strip()] if given else list(known)
    if unknown := [n for n in names if n not in known]:
        parser.error(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def _offline(replicas: Iterable[ReplicaConfig]) -> None:
    """The data is local, always: no dataset hub. Models too, where every source is a
    directory; a hub model (opt-cpu's) may still need its tokenizer fetched."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if all(Path(r.source).is_dir() for r in replicas):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _thesis_row(spec: ModelsFile, model: str) -> ThesisRow | None:
    """The thesis's name for `model`: its own, or the model it stands in for."""
    quality = spec.quality
    names = {name for row in quality.tasks.values() for name in row}
    stands_in_for = spec.models[model].stands_in_for
    name = model if model in names else stands_in_for
    if name is None or name not in names:
        return None
    return ThesisRow(name, stand_in=name != model, derived=name in quality.derived)


@contextlib.contextmanager
def _server(config: str, deployment: str, port: int | None) -> Iterator[str]:
    """`python -m serving` for `deployment`, up until every replica is ready; its URL.

    Admission control is off: a quality run measures the models, and a request shed because
    the engines were busy with its own batch would only be retried."""
    from tqdm import tqdm

    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix=f"quality-{deployment}-", suffix=".log")[1])
    flags = ["--config", config, "--h3-port", "0", "--request-log", "off", "--admission", "none"]
    command = serving_command(deployment, port, *flags)
    with (
        launch("the server", command, port, "/readyz", log) as server,
        tqdm(desc="starting the server", bar_format="{desc}: {elapsed}") as waiting,
    ):
        try:
            server.ready(STARTUP_TIMEOUT_S, tick=waiting.update)
        except NotReady as exc:
            sys.exit(f"{exc}\n(the whole log: {log})")
        waiting.close()
        yield server.url
    log.unlink()  # kept only when something went wrong


if __name__ == "__main__":
    sys.exit(main())
