"""verl on object storage: ``trainer.default_local_dir: s3://...`` (or ``gs://``, or
``trainer.default_hdfs_dir`` beside a local one), by configuration alone under
``cloudckpt run``.

verl 0.9.1's FSDP backend writes, per saved step::

    {default_local_dir}/global_step_{N}/
        actor/{model,optim,extra_state}_world_size_{W}_rank_{R}.pt   each rank's torch.save
        actor/huggingface/, actor/fsdp_config.json                    rank 0
        critic/...                                                    when there is a critic
        data.pt                                                       the dataloader
    {default_local_dir}/latest_checkpointed_iteration.txt            the tracker

The same layout goes to the bucket, each role committed by its workers (one manifest
per role), then ``data.pt`` and one root manifest per step; the tracker is written
only after that commit, and verl's retention then runs over whole committed steps. A
crash at any point leaves the previous step as the newest committed one, which is what
``resume_mode: auto`` resumes (verl's own resume reads the tracker and trusts the
files). The files are verl's own, so a downloaded step resumes under verl itself.

The package: ``plugin`` (the declaration), ``binding`` (what activation binds),
``commands`` (``cloudckpt verl ...``), ``layout`` (verl's names), ``resume`` (which
step), then one module per job: ``workers`` (``FSDPCheckpointManager`` on a bucket),
``trainer`` (``RayPPOTrainer``'s save and load), ``sft`` (its SFT trainer's handler),
``localsteps`` (steps on local disk, to and from a bucket), ``paths`` (its other path
keys) and ``doctor`` (a launch, read).
"""
