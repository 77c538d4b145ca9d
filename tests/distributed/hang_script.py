"""Run with 2 processes: rank 0 waits at a gloo barrier that rank 1 never reaches (a deliberate hang, for
test_launch_stacks.py)."""

import time

import torch.distributed as dist


def never_arrives():
    time.sleep(3600)


def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.barrier()
    else:
        never_arrives()


if __name__ == "__main__":
    main()
