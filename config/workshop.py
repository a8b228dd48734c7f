# The workshop's short run (WORKSHOP.md): the previous default recipe (4,000 iterations, no weight averaging) in half
# the iterations, its curricula halved too: about 2-3 minutes on a 2-core laptop. Passkey retrieval first, then one
# batch in three is language modeling.
#   python train.py config/workshop.py
out_dir = "out-workshop"
max_iters = 2000
ema_decay = 0.0              # WORKSHOP.md's numbers were measured without the average
logn_scale = True            # and with log-n query scaling beyond the trained chunks
chunk_schedule = "1:500,2:1000"   # 1 chunk, then 2, then 4 from iteration 1000
beta_schedule = "2:500"
lm_from = 1250
eval_interval = 500
eval_chunks = "4"
final_eval_chunks = "4,16,64"      # up to 8K context tokens: 16x the longest training context
final_eval_iters = 0               # the last eval as large as the others (WORKSHOP.md measured so)
