"""Every kind of event in ``metrics.jsonl``, in one place, with its fields.

Each line of ``metrics.jsonl`` is one JSON object with ``event`` (one of the
kinds below) and ``time`` (Unix seconds, stamped when it was reported).
Events reported by workers also carry ``worker`` (its id), ``src`` and
``seq`` (the reporting process and its sequence number: each event is written
exactly once). ``tests/test_events.py`` fails when the code writes or reads a
kind that is not listed here.
"""

from __future__ import annotations

KINDS: dict[str, str] = {
    # ---- training (workers) ----
    "step": "stage 0, one per committed step: replica, step, loss, tokens, lr, clip_coef, epoch, route, and the "
            "stage's time split step_s compute_s serialize_s transport_s idle_s, bytes_out raw_bytes_out "
            "bytes_in raw_bytes_in (bytes_down: of bytes_out, those to the next stage); serialize_cpu_s: of "
            "serialize_s, the CPU time of the threads that serialized and decoded (the rest is waiting: for the "
            "GIL, a core, the device)",
    "stage_step": "every other stage, one per committed step: replica, stage, step, and the same time split",
    "step_aborted": "stage 0: an attempt of a step abandoned (route change): replica, step, reason, lost_s",
    "eval": "stage 0: held-out loss: replica, step, loss, seconds",
    "goodput": "stage 0, every 10 s and when its replica is done: its worker's time ledger (crucible.ledger): "
               "replica, step, compute_s communication_s checkpoint_stall_s lost_s paused_s recovering_s eval_s "
               "restart_s stopped_s (adding up to wall_s, since the worker started: a replacement's process start) goodput",
    "replica_done": "stage 0: its replica trained every step: replica, step",
    "outer": "a stage's outer round applied: replica, stage, round, step, mode, contributors, left_out, "
             "undecodable, bytes_sent, bytes_received, dense_bytes, encode_s, apply_s, seconds",
    "outer_resync": "a stage too far behind the outer rounds took θ_global from a peer: replica, stage, reason, "
                    "source, step",
    "replacement_ready": "a replacement has its weights: replica, stage, source (peer slot, checkpoint or init), "
                         "step, seconds, startup_s (seconds per start-up phase since the process started: imported, "
                         "job_info, built, registered, wired, ready, and the total; cpu_s: the CPU seconds it used; loadavg)",
    "stage_lost": "a replacement found no live copy of its stage and no new-enough checkpoint: replica, stage, "
                  "slot_step, reason",
    "suspect": "a worker's call to a neighbour failed: replica, stage (the neighbour), by, reason, epoch (the "
               "stream's route epoch); dropped (why it was not acted on: a stream of an older route)",
    "worker_error": "a worker is dying of an exception: replica, stage, error (its last line)",
    # ---- checkpoints (workers) ----
    "ckpt_persister": "a worker started its persister process: replica, stage, pid",
    "ckpt_restore": "a worker loaded its state from a checkpoint: replica, stage, step, outer_round, dir, seconds "
                    "(source: another replica's shard, for a slot vacant in it)",
    "ckpt_error": "a worker's previous persist failed: replica, stage, error",
    "snapshot": "a worker's snapshot for a save: replica, stage, step, stall_s (the training loop's pause), "
                "wait_previous_s, queued_s, copy_s, bytes, pinned",
    "device": "a worker's device, at join and every 10 s on a GPU: replica, stage, device, and on CUDA "
              "device_name, mem_total_mb, mem_allocated_mb, mem_reserved_mb, mem_peak_mb",
    # ---- the coordinator ----
    "coordinator_start": "address, incarnation, pid, replicas, stages, restored, version, config",
    "coordinator_isolated": "a majority of at least two live workers went silent at once: the coordinator is "
                            "probably cut off and evicts nobody for silence until they are heard again: silent "
                            "(their names), live",
    "coordinator_reconnected": "a majority is heard again after coordinator_isolated: silent, live",
    "coordinator_restored": "a restarted coordinator continues its predecessor's membership: incarnation, "
                            "workers, routes",
    "worker_registered": "worker, replica, stage, address, pid, replacement, rejoin, numel, corpus (stage 0: the "
                         "corpus it read)",
    "worker_joined": "a replacement is ready and in its route again: worker, replica, stage",
    "worker_done": "a worker says its replica is done: worker, replica, stage",
    "fault": "a worker declared dead: kind (worker_dead), worker, replica, stage, pid, reason, probe_s, "
             "last_seen (Unix time of its last heartbeat)",
    "route_change": "epoch, reason, routes (replica -> stages), states (replica -> state)",
    "job_done": "every replica is done: elapsed_s, steps",
    "job_stopped": "the coordinator got SIGTERM or SIGINT (a preemption notice) before the last step: it takes "
                   "a final checkpoint and stops every worker: signal, steps (per replica)",
    "job_rollback": "a stage lost every copy: every worker restarts from the latest checkpoint: reason, replica, "
                    "stage, to_step",
    "outer_round": "a round closed: stage, round, contributors, dropped, bytes, seconds (logged just before the "
                   "round is on disk: a coordinator killed in between re-forms it and logs it again; the later "
                   "line stands)",
    "outer_waiting": "a round past outer.deadline_s still waits: stage, round, missing",
    "outer_skipped": "a stage skipped an outer round, the coordinator out of reach (its update kept in e): "
                     "replica, stage, round, step, reason",
    "outer_abandoned": "an outer round nobody applies (a replica skipped it first); the coordinator's: stage, "
                       "round, contributions, seconds; a worker's: replica, stage, round, step",
    "outer_settled": "a skipped round's final outcome, once the coordinator answered again: replica, stage, "
                     "round, abandoned, contributors",
    "link_eviction": "a broken link between two live workers: one end evicted after repeated contradicted "
                     "suspicions: replica, stages, evicted",
    "outer_forgotten": "at a resume or a fresh start: outer rounds of the abandoned timeline removed: from_round, "
                       "rounds",
    "outer_caught_up": "a replacement replayed the outer rounds closed since its weights' round: replica, stage, "
                       "from_round, rounds, source",
    "outer_ahead": "an outer contribution or peek for a round more than LEAD_ROUNDS past its replica's steps, "
                   "held back (\"ask again\") until they catch up; once per worker, stage and round: worker, "
                   "replica, stage, round, limit (the newest round it may open yet), step",
    "outer_rejected": "a contribution refused (its sender is left out of the round): replica, stage, round, reason",
    "prometheus": "where /metrics is served: address, path",
    "ckpt_start": "a save named: step, margin, final, end, replica_steps, shards, vacant",
    "ckpt_commit": "a save committed: step, final, end, stall_s, stall_median_s, persist_s, persist_median_s, "
                   "bytes, shards, vacant, duration_s, commit_s, replica_steps",
    "ckpt_abort": "a save abandoned: step, reason, final, shards_in",
    "ckpt_vacant": "a save goes on without a slot whose worker was lost before its shard was in (its replica "
                   "skips the stage): step, slot, reason",
    "ckpt_late": "a replica learnt a save's target too late: step, replica, stage, error, current",
    "ckpt_shard_failed": "a worker's shard of a save failed: step, replica, stage, error, current",
    "ckpt_delete": "retention deleted a checkpoint: step",
    "ckpt_clean": "leftovers of interrupted saves removed at start: removed",
    "ckpt_resume": "--resume chose a checkpoint: step, path, replicas, vacant, changed (this job's configuration "
                   "keys that differ from its own), outer_origin (the outer rounds' numbering from here on: "
                   "crucible/coordinator/outer.py), corpus_unchecked (the checkpoint records no corpus, an older "
                   "Crucible's: the data read is not checked against it) (step None: none to resume)",
    "ckpt_damaged": "a checkpoint failed verification at --resume: step, path, problems",
    "ckpt_incomplete": "a checkpoint skipped at --resume: a stage has no shard in it: step, stages_missing",
    "ckpt_set_aside": "a checkpoint after the one resumed moved aside: step, path",
    "ckpt_notice": "a checkpoint setting that has no effect: notice, ...",
    "ckpt_final_requested": "SIGTERM: a final checkpoint asked for: pending",
    "ckpt_final_skipped": "no final checkpoint possible: reason",
    "ckpt_final_timeout": "the final checkpoint did not commit in time: timeout_s",
    # ---- the launcher and the cluster supervisors ----
    "launch_start": "a `crucible launch` began, before its pre-flight (it holds launch.lock while it lives): pid, "
                    "resume; its coordinator_start follows unless the launch ended first",
    "chaos": "the launcher's fault injection: signal, target, pid, mono",
    "job_restart": "the launcher restarts everything from the latest checkpoint: reason",
    "job_restarted": "... and everything is up again: seconds",
    "slurm_submit": "crucible slurm submitted a slot's job: slot, job_id, ...",
    "slurm_job_start": "a slot's Slurm job is running: slot, job_id, node, ...",
    "slurm_job_end": "a slot's Slurm job ended: slot, job_id, state, ...",
    "slurm_stuck": "a running job whose slot the coordinator does not see alive was cancelled: slot, job_id, ...",
    "slurm_down": "crucible slurm down finished: jobs_left, seconds, ...",
}

# The kinds a worker reports (the Report RPC). Every other kind listed above is
# the coordinator's or a supervisor's own, and the coordinator refuses a report
# carrying one (INVALID_ARGUMENT): a worker does not say that the job is done
# or stopped (what the launcher ends on), that a worker died, or where a route
# goes. ``tests/test_events.py`` checks this against what crucible/worker writes.
REPORTED = frozenset({
    "step", "stage_step", "step_aborted", "eval", "goodput", "replica_done", "outer", "outer_resync",
    "replacement_ready", "stage_lost", "suspect", "worker_error", "ckpt_persister", "ckpt_restore", "ckpt_error",
    "snapshot", "device", "outer_skipped", "outer_abandoned", "outer_settled", "outer_caught_up",
})
