"""Slurm's own words for a job's state and reason, beyond the words every backend shares (scheduler/task_view.py:
PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, PREEMPTED, UNKNOWN; CACHED and INTERRUPTED are the
run's). The backend declares the ended ones and the never-runs reason (SlurmBackend), so status, --wait and the
report read them through the registry; the requeued and held ones only its parser reads (parse.py)."""

from __future__ import annotations

# Ended without a result (with FAILED, TIMEOUT and CANCELLED).
FAILED_STATES = frozenset({"OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "REVOKED"})
# Put back in the queue by Slurm: the task waits to run again from its checkpoint (the launchers submit with
# --requeue), so it has not ended. PREEMPTED is final only where the site cancels preempted jobs: a task still
# PREEMPTED after task_view.UNKNOWN_GRACE_S counts as ended (poll). A held one (REQUEUE_HOLD, SPECIAL_EXIT) waits
# for `scontrol release`.
REQUEUE_STATES = frozenset({"PREEMPTED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT"})
HELD_STATES = frozenset({"REQUEUE_HOLD", "SPECIAL_EXIT"})
# squeue's reason for a job whose dependency can never be satisfied (an afterok on a job that failed)
NEVER_SATISFIED = "DependencyNeverSatisfied"
