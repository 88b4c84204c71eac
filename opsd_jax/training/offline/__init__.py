"""Offline Visual-OPSD in one place: a teacher run once over the training data and cached, then
a student trained against the cache without a teacher forward.

- cache.py: the cache on disk (manifest, committed shards), its writer and its reader, and the
  check that a cache was made for this model, tokenizer and prompt;
- views.py: the two views of a sample (text-only for the student; the teacher's with the VT
  images) and the offline micro-batch (the text-only pack + the cached teacher at its entries);
- collect.py: the collector (scripts/collect_traces.py is its command line);
- checks.py: what a cache is checked against beyond its manifest's model and prompt: the
  digest of its teacher's weights, the image transform, and every training sample covered.

The loss against the cache is the loss package's (training/losses/offline.py, with the online
losses it is compared with); train.py runs the mode through training/step_batches.py
(`OfflineBatches`) and train_step.make_offline_loss.
"""
