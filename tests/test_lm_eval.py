"""lm-evaluation-harness (`lm-eval`, its `local-completions` model) through the gateway: a
loglikelihood task (echo + logprobs) and a generate-until task on local data
(tests/lm_eval_tasks/), on the demo pair: once against the demo target speculating with the demo
DFlash drafter and once against the target alone. Scores and every per-sample response agree."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from splitspec.v1 import generation_pb2 as pb
from tests.procs import Service, private_shm_dir, start_gateway, wait_drafter

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ("splitspec_choice", "splitspec_complete")
DEMO = Path(__file__).resolve().parents[1] / "demo"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """Two gateways on the demo target: one before it speculating with the demo DFlash drafter, one
    before it alone."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    model = DEMO / "target"
    shm = private_shm_dir()
    services: list[Service] = []
    try:
        drafter = Service("draft_service.cli", ["--kind", "dflash", "--model", str(DEMO / "dflash"), "--target-model",
                                                str(model), "--port", "0", "--shm-dir", str(shm)],
                          tmp / "drafter.log")
        services.append(drafter)
        drafter.wait_serving()
        addresses = {}
        for name, extra in (("speculative", ["--drafter", drafter.address, "--speculative-policy", "fixed"]),
                            ("plain", [])):
            target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm),
                                                    *extra], tmp / f"target-{name}.log")
            services.append(target)
            target.wait_serving()
            if extra:
                wait_drafter(target.address, pb.DrafterState.STATUS_READY)
            gateway = start_gateway(target.address, tmp / f"gateway-{name}.log")
            services.append(gateway)
            addresses[name] = gateway.address
        yield model, addresses, tmp
    finally:
        for service in reversed(services):
            service.kill()
        shutil.rmtree(shm, ignore_errors=True)


def task_folder(tmp: Path) -> Path:
    """The task YAMLs with their data's absolute folder."""
    out = tmp / "tasks"
    out.mkdir(exist_ok=True)
    for yaml in TASKS_DIR.glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("DATA_DIR", str(TASKS_DIR.resolve())))
    return out


def evaluate(model: Path, gateway: str, tasks: Path) -> dict:
    from lm_eval.tasks import TaskManager

    model_args = (f"model={model},base_url=http://{gateway}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={model},num_concurrent=1,max_retries=1,tokenized_requests=True")
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=list(TASKS),
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def responses(result: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_scores_agree_with_speculation_on_and_off(gateways):
    model, addresses, tmp = gateways
    tasks = task_folder(tmp)
    speculative = evaluate(model, addresses["speculative"], tasks)
    plain = evaluate(model, addresses["plain"], tasks)
    assert speculative["results"]["splitspec_choice"]["acc,none"] == plain["results"]["splitspec_choice"]["acc,none"]
    assert (speculative["results"]["splitspec_complete"]["exact_match,none"]
            == plain["results"]["splitspec_complete"]["exact_match,none"])
    choices = [sum(responses(r, "splitspec_choice"), []) for r in (speculative, plain)]
    assert len(choices[0]) == len(choices[1]) == 8 * 4  # every choice of every document was scored
    for (a, _), (b, _) in zip(*choices):
        assert math.isclose(a, b, abs_tol=1e-4)  # the loglikelihood of each choice
    generated = [responses(r, "splitspec_complete") for r in (speculative, plain)]
    assert len(generated[0]) == 6 and generated[0] == generated[1] and any(text for [text] in generated[0])
    print({task: speculative["results"][task] for task in TASKS})
