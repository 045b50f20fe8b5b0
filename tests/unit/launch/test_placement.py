"""services/launch/placement.py: the device of each TP rank, and where ``pdserve up`` puts its workers.

Pure functions of a GPU count, so every case (no GPU, enough, too few, hand-chosen) runs on CPU.
"""

from __future__ import annotations

import pytest

from services.launch.placement import gpu_pool, parse_gpu_list, plan_placement, rank_devices


@pytest.mark.parametrize("device,tp,num_gpus,expected", [
    ("auto", 1, 0, ["cpu"]),
    ("auto", 4, 0, ["cpu"] * 4),
    ("auto", 2, 8, ["cuda:0", "cuda:1"]),
    ("cpu", 3, 8, ["cpu"] * 3),
    ("cuda", 1, 1, ["cuda:0"]),
    ("cuda", 2, 2, ["cuda:0", "cuda:1"]),
    ("cuda:3", 1, 4, ["cuda:3"]),
    ("cuda:2", 2, 4, ["cuda:2", "cuda:3"]),
    ("cuda:2,cuda:0", 2, 4, ["cuda:2", "cuda:0"]),
    (" cuda:1 , cuda:3 ", 2, 4, ["cuda:1", "cuda:3"]),
    ("cpu,cpu", 2, 0, ["cpu", "cpu"]),
])
def test_rank_devices_forms(device: str, tp: int, num_gpus: int, expected: list[str]) -> None:
    assert rank_devices(device, tp, num_gpus) == expected


@pytest.mark.parametrize("device,tp,num_gpus,message", [
    ("auto", 4, 2, "tp 4 needs 4 GPUs, only 2 visible"),  # GPUs there, too few: not a silent CPU run
    ("cuda", 1, 0, "needs GPU 0 but only 0 GPU(s) visible"),
    ("cuda", 4, 2, "needs GPU 2,3 but only 2 GPU(s) visible (0-1)"),
    ("cuda:3", 2, 4, "needs GPU 4"),
    ("cuda:0,cuda:0", 2, 4, "GPU 0 listed twice"),
    ("cuda:0,cuda:1", 3, 4, "2 entries for tp 3"),
    ("cuda:0,cuda:1,cuda:2", 2, 4, "3 entries for tp 2"),
    ("cpu,cuda:0", 2, 4, "mixes cpu and cuda"),
    ("cpu,cpu", 3, 0, "2 entries for tp 3"),
    ("gpu:0", 1, 4, "bad device 'gpu:0'"),
    ("cuda:x", 1, 4, "bad device 'cuda:x'"),
    ("cuda:-1", 1, 4, "bad device"),
    ("cuda,cuda:1", 2, 4, "bad device 'cuda'"),
    ("", 1, 4, "bad device ''"),
    ("cpu", 0, 4, "at least 1"),
])
def test_rank_devices_errors(device: str, tp: int, num_gpus: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rank_devices(device, tp, num_gpus)


def test_parse_gpu_list() -> None:
    assert parse_gpu_list("0,1, 3") == [0, 1, 3]
    for bad in ("0,,1", "a", "0,-1", ""):
        with pytest.raises(ValueError, match="GPU"):
            parse_gpu_list(bad)


@pytest.mark.parametrize("device,num_gpus,expected", [
    ("cpu", 4, []), ("auto", 0, []), ("auto", 2, [0, 1]), ("cuda", 3, [0, 1, 2]),
    ("cuda:1", 2, [1]), ("cuda:3,cuda:1", 4, [3, 1]),
])
def test_gpu_pool(device: str, num_gpus: int, expected: list[int]) -> None:
    assert gpu_pool(device, num_gpus) == expected


@pytest.mark.parametrize("device,num_gpus,message", [
    ("cuda", 0, "no CUDA device"), ("cuda:2", 2, "needs GPU 2"), ("cuda:0,cuda:0", 2, "listed twice"),
    ("cpu,cuda:0", 2, "mixes cpu and cuda"),
])
def test_gpu_pool_errors(device: str, num_gpus: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gpu_pool(device, num_gpus)


def test_no_gpu_everything_on_cpu() -> None:
    p = plan_placement(0, [2], [1, 1])
    assert (p.prefill, p.decode) == (["cpu"], ["cpu", "cpu"])
    assert "no GPU visible" in p.explanation and "run on CPU" in p.explanation


def test_device_cpu_keeps_gpus_unused() -> None:
    p = plan_placement(4, [1], [1], gpus=[])
    assert (p.prefill, p.decode) == (["cpu"], ["cpu"])
    assert "--device cpu" in p.explanation


def test_enough_gpus_every_rank_its_own() -> None:
    p = plan_placement(8, [2, 2], [1, 1])
    assert p.prefill == ["cuda:0,cuda:1", "cuda:2,cuda:3"]
    assert p.decode == ["cuda:4", "cuda:5"]
    assert "every rank on its own GPU" in p.explanation and "shared" not in p.explanation


def test_one_gpu_prefill_and_decode_share_it() -> None:
    p = plan_placement(1, [1], [1])
    assert (p.prefill, p.decode) == (["cuda:0"], ["cuda:0"])
    assert "GPU 0 is shared by prefill 0 and decode 0" in p.explanation


def test_too_few_gpus_roles_keep_separate_gpus_when_they_can() -> None:
    # 6 ranks on 4 GPUs: prefill gets its share (1 GPU), decode the rest; same-role workers share.
    p = plan_placement(4, [1, 1], [1, 1, 1, 1])
    assert p.prefill == ["cuda:0", "cuda:0"]
    assert p.decode == ["cuda:1", "cuda:2", "cuda:3", "cuda:1"]
    assert "prefill and decode keep separate GPUs" in p.explanation
    assert "GPU 0 is shared by prefill 0 and prefill 1" in p.explanation


def test_too_few_gpus_for_separate_roles_share_across_roles() -> None:
    # tp 2 + tp 2 on 3 GPUs: neither split holds both, so the least loaded GPUs are shared.
    p = plan_placement(3, [2], [2])
    assert p.prefill == ["cuda:0,cuda:1"]
    assert p.decode == ["cuda:0,cuda:2"]
    for devices in (*p.prefill, *p.decode):
        assert len(set(devices.split(","))) == len(devices.split(","))  # a worker's ranks stay distinct
    assert "workers share GPUs" in p.explanation


def test_tp_larger_than_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match="tp 4 worker needs 4 distinct GPUs but only 2 usable"):
        plan_placement(2, [1], [4])
    with pytest.raises(ValueError, match="at least 1"):
        plan_placement(2, [0], [1])


def test_hand_chosen_gpus_in_order() -> None:
    p = plan_placement(4, [1, 1], [2], prefill_gpus=[3, 2], decode_gpus=[0, 1])
    assert p.prefill == ["cuda:3", "cuda:2"]
    assert p.decode == ["cuda:0,cuda:1"]
    assert "--prefill-gpus 3,2" in p.explanation and "--decode-gpus 0,1" in p.explanation


def test_hand_lists_may_overlap_to_share_on_purpose() -> None:
    p = plan_placement(2, [1], [1], prefill_gpus=[0], decode_gpus=[0])
    assert (p.prefill, p.decode) == (["cuda:0"], ["cuda:0"])
    assert "GPU 0 is shared by prefill 0 and decode 0" in p.explanation


def test_hand_list_surplus_stays_unused_and_other_role_avoids_it() -> None:
    p = plan_placement(4, [1], [1], prefill_gpus=[0, 1])
    assert (p.prefill, p.decode) == (["cuda:0"], ["cuda:2"])
    assert "GPU 1 left unused" in p.explanation and "decode placed automatically" in p.explanation


def test_other_role_shares_hand_chosen_gpus_when_none_is_free() -> None:
    p = plan_placement(2, [1], [1, 1], decode_gpus=[0, 1])
    assert p.decode == ["cuda:0", "cuda:1"]
    assert p.prefill == ["cuda:0"]
    assert "GPU 0 is shared by prefill 0 and decode 0" in p.explanation


@pytest.mark.parametrize("kwargs,message", [
    (dict(prefill_gpus=[0]), r"--prefill-gpus 0: lists 1 GPU\(s\) but 1 prefill worker\(s\) at tp 2 need 2"),
    (dict(decode_gpus=[0, 1]), r"--decode-gpus 0,1: lists 2 GPU\(s\) but 3 decode worker\(s\) at tp 1,1,1 need 3"),
    (dict(prefill_gpus=[1, 1]), "GPU 1 listed twice"),
    (dict(prefill_gpus=[0, 7]), "needs GPU 7 but only 4 GPU"),
])
def test_hand_chosen_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_placement(4, [2], [1, 1, 1], **kwargs)


def test_hand_chosen_gpus_without_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="--decode-gpus 0: there is no GPU to use"):
        plan_placement(0, [1], [1], decode_gpus=[0])


def test_device_restricts_the_automatic_pool() -> None:
    p = plan_placement(4, [1], [1], gpus=[2, 3])
    assert (p.prefill, p.decode) == (["cuda:2"], ["cuda:3"])
    assert "GPU 2,3 (from --device)" in p.explanation


def test_roles_with_no_workers() -> None:
    p = plan_placement(2, [], [1, 1])
    assert (p.prefill, p.decode) == ([], ["cuda:0", "cuda:1"])
