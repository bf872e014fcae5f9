"""The command line as a new user meets it: a cluster of GPUs this machine does not have is
refused in one line (or emulated when asked, saying so); progress is a line every tenth of the
steps when stdout is not a terminal; memory is shown in a unit that fits."""

import hap
from hap.cli import main
from hap.plan import _size


def test_train_refuses_gpus_not_on_this_machine(capsys):
    assert main(["train", "--model", "vit", "--cluster", "paper-hetero-8", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hap: error: cluster 'paper-hetero-8' describes 8 GPUs that are not on this machine")


def test_train_prints_a_line_every_tenth_of_the_steps(capfd):  # capfd: the ranks print, not this process
    assert main(["train", "--model", "vit", "--steps", "20", "--strategy", "dp-ev"]) == 0
    out = capfd.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{k}/20" for k in range(2, 21, 2)]
    assert "memory per GPU:" in out and ("KiB" in out or "MiB" in out)


def test_sizes_read_in_a_unit_that_fits():
    assert [_size(b) for b in (512, 3 * 2**10, 5.5 * 2**20, 40 * 2**30)] == ["512 B", "3.0 KiB", "5.5 MiB", "40.0 GiB"]


def test_profiled_local_clusters_stay_local():
    from hap.cost.cluster import cluster_from_dict

    local = hap.load_cluster("local")
    assert local.local and not hap.load_cluster("paper-hetero-8").local
    assert cluster_from_dict(local.to_dict()).local
