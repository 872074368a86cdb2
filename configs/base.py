"""Every meshlm setting with its default. Other configs start from this one and change a few keys.

Sections: model, mesh, train, data, checkpoint, log, distributed, rl. Unknown keys are rejected (the ConfigDict is
locked), so a typo in an override fails before anything runs.
"""
import ml_collections

from model import config as model_config


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # The model's keys, defaults and comments live with the model (model/config.py: default_model_config), which
  # validates them; every other section is defined here.
  c.model = model_config.default_model_config()

  mesh = c.mesh = ml_collections.ConfigDict()
  # Devices per axis inside a slice/host (ICI); -1 = all remaining. ICI x DCN products must equal the device count.
  mesh.data = -1  # pure data parallelism (parameters replicated)
  mesh.fsdp = 1  # data parallelism with parameters, gradients and optimizer state sharded (ZeRO-3)
  mesh.tensor = 1  # tensor (Megatron) parallelism over heads / mlp / vocab
  mesh.sequence = 1  # sequence (context) parallelism over the length axis of activations
  mesh.expert = 1  # expert parallelism: MoE experts split over it; outside MoE layers it splits the batch
  mesh.stage = 1  # pipeline parallelism: the scanned layer stack split into this many stages (docs/pipeline.md)
  # Across slices/hosts (DCN); the product of dcn_* is the number of slices (or hosts). Tensor/sequence stay in ICI.
  mesh.dcn_data = -1  # data parallelism across slices/hosts; -1 = all slices (or hosts) not used by dcn_fsdp
  mesh.dcn_fsdp = 1  # fsdp across slices/hosts (parameters sharded over the slow network too)
  mesh.rules = ()  # overrides of the logical-axis rules: ((logical_name, mesh_axis or (axes...) or None), ...)

  t = c.train = ml_collections.ConfigDict()
  t.steps = 1000  # optimizer steps
  t.batch_size = 256  # global batch in sequences per optimizer step (all microbatches together)
  t.seq_len = 2048  # tokens per sequence
  t.grad_accum = 1  # microbatches per step (lax.scan), same math as one large batch
  t.lr = 3e-4  # peak learning rate
  t.min_lr_ratio = 0.1  # final learning rate as a fraction of the peak (cosine / decay phase end)
  t.schedule = "cosine"  # cosine (linear warmup + cosine) | wsd (warmup-stable-decay) | constant (after warmup)
  t.warmup_steps = 100  # linear warmup from 0 to lr
  t.decay_fraction = 0.2  # wsd: fraction of the steps spent in the final decay
  t.optimizer = "adamw"  # adamw | muon | adafactor | lion | schedule_free_adamw (train/core/optimizer.py)
  t.opt_state_dtype = "float32"  # float32 | bfloat16: the optimizer's per-parameter state between steps
  t.b1 = 0.9  # AdamW beta1 (lion: the update's interpolation; schedule_free_adamw: its y interpolation)
  t.b2 = 0.95  # AdamW beta2 (lion: the momentum's decay, 0.99 in its paper)
  t.eps = 1e-8  # AdamW epsilon
  t.muon_momentum = 0.95  # muon: momentum of the matrices' gradients
  t.muon_nesterov = True  # muon: Nesterov momentum
  t.muon_ns_steps = 5  # muon: Newton-Schulz iterations
  t.muon_ns_coeffs = (3.4445, -4.775, 2.0315)  # muon: (a, b, c) of a X + b X X^T X + c (X X^T)^2 X, or one triple per step
  t.muon_rms = 0.2  # muon: update RMS matched to AdamW's, scale muon_rms * sqrt(max(fan_in, fan_out)); 0 = sqrt(max(1, fan_out / fan_in))
  t.adafactor_decay_rate = 0.8  # adafactor: second-moment decay 1 - (t + 1)^-rate
  t.adafactor_clip = 1.0  # adafactor: clip each update to this block RMS; 0 disables
  t.adafactor_momentum = 0.0  # adafactor: EMA of the updates (0 = none, as in its paper)
  t.adafactor_min_dim_to_factor = 128  # adafactor: factor the second moment of matrices with both sides >= this
  t.schedule_free_weight_lr_power = 2.0  # schedule_free_adamw: average weights lr^power
  t.weight_decay = 0.1  # decoupled weight decay
  t.decay_exclude = ("norm", "bias", "embedding")  # parameter-path substrings without weight decay (unembed decays)
  t.clip_norm = 1.0  # global-norm gradient clipping threshold; 0 disables
  t.z_loss = 1e-4  # coefficient of the z-loss (logsumexp^2)
  t.remat = "none"  # none | full | save_dots | minimal | save_qkv_proj | save_attn | save_out_proj | save_qkv_mlp_in | save_dot_except_mlpwi | offload_input | offload_qkv_out
  t.seed = 0  # seed for parameter init and any training randomness
  t.log_every = 10  # steps between metric lines
  t.eval_every = 200  # steps between held-out evaluations; 0 disables
  t.eval_steps = 10  # batches per evaluation
  t.max_nonfinite = 5  # halt after this many consecutive steps with a non-finite loss or gradient
  t.init_from = ""  # start from weights only: a meshlm run directory / checkpoint, or a Hugging Face directory
  t.debug_nan_steps = ()  # fault injection for tests: steps whose loss mask is NaN (the step must skip and count)
  t.peak_tflops = 0.0  # hardware peak per device for MFU; 0 = look up the device kind (CPU: MFU omitted)
  t.schedule_steps = 0  # learning-rate schedule horizon in steps; 0 = train.steps (a resumed run keeps its own)
  t.moe_aux_loss = 0.01  # coefficient of the MoE load-balancing loss (Switch: E * sum_e f_e P_e, mean over MoE layers)
  t.router_z_loss = 0.001  # coefficient of the MoE router z-loss (mean logsumexp(router logits)^2, ST-MoE)
  t.mtp_loss_weight = 0.3  # model.mtp_depth > 0: weight of the multi-token-prediction loss (DeepSeek-V3: 0.3, later 0.1)
  t.router_bias_update_rate = 0.0  # model.router=sigmoid: each step every MoE layer's score bias moves by this times
  # sign(mean load - expert load) (DeepSeek-V3's auxiliary-loss-free balancing: 0.001); 0 = fixed biases
  t.eval_tasks = ""  # benchmark tasks NAME:PATH[,...] (docs/evaluation.md) run at every evaluation; empty = none
  t.eval_tasks_limit = 0  # documents per eval task during training (the first N); 0 = all
  t.objective = "lm"  # what the step optimises: lm (next-token) | sft (chat, assistant tokens) | reward | dpo (pairs) | mlm (masked LM, model.causal=false) | prefix_lm | distill (from a teacher); ppo | grpo (python -m train.rl)
  t.lora_rank = 0  # LoRA adapter rank on lora_targets, base weights frozen; 0 = train every weight
  t.lora_alpha = 16.0  # LoRA scale numerator: adapted W = W + (lora_alpha / lora_rank) * A @ B
  t.lora_targets = ("q", "k", "v", "o")  # projections LoRA adapts (any of q k v o gate up down)
  t.lora_rslora = False  # rsLoRA: scale the adapters by lora_alpha / sqrt(lora_rank) instead of lora_alpha / lora_rank
  t.lora_dropout = 0.0  # dropout probability on each adapter's input (training steps only), in [0, 1)
  t.lora_base_quant = "none"  # QLoRA: frozen base kernels stored as none | int8 (per channel) | nf4 (4-bit, 64-blocks)
  t.lora_base_double_quant = False  # nf4: NF4's block constants quantized again to 8-bit floats (QLoRA's DQ)
  t.base_recipe = ""  # with no init_from: a config whose run (WORKDIR/../NAME) is made or reused first and started from
  t.context_extension = False  # with init_from / base_recipe: this config's model.max_seq_len and RoPE keys replace
  # the checkpoint's (continued pretraining at a longer context: docs/long-context.md); otherwise the checkpoint's rule
  t.eval_generations = 0  # held-out chat prompts per task family answered greedily at each eval (eval_exact_match); 0 = off
  t.eval_max_new_tokens = 32  # longest greedy answer generated for eval_exact_match
  t.freeze = ()  # parameter-path substrings kept frozen: zero update, no optimizer state (e.g. ("embed", "norm"))
  t.reward_center = 0.0  # reward objective: coefficient of the centering term mean((r_chosen + r_rejected)^2); 0 = off
  t.dpo_beta = 0.1  # dpo: KL strength beta (implicit reward = beta * log(pi / pi_ref))
  t.dpo_loss = "sigmoid"  # dpo loss: sigmoid (DPO) | ipo (IPO, squared) | hinge (SLiC, max(0, 1 - beta*h))
  t.dpo_label_smoothing = 0.0  # dpo sigmoid loss: probability eps that a label is flipped (conservative DPO); 0 = off
  t.dpo_rpo_alpha = 0.0  # dpo: weight of the chosen answer's mean token NLL in the loss (RPO, Pang 2024); 0 = off
  t.distill_teacher = ""  # distill: the frozen teacher, a meshlm run or Hugging Face directory (the student's vocab)
  t.distill_teacher_recipe = ""  # distill, no distill_teacher: a config whose run WORKDIR/../NAME is made/reused as it
  t.distill_loss = "forward_kl"  # distill, per token: forward_kl KL(p_T||p_S) | reverse_kl KL(p_S||p_T) | jsd
  t.distill_beta = 0.5  # distill_loss=jsd: M = beta p_T + (1-beta) p_S, in [0, 1] (0 = forward_kl, 1 = reverse_kl)
  t.distill_temperature = 1.0  # distill: both models' logits divided by T before the softmax (no T^2 factor, as TRL)
  t.distill_top_k = 0  # distill: only the teacher's k likeliest tokens, both renormalised over them; 0 = whole vocab
  t.distill_lm_weight = 0.0  # distill: weight of the student's cross-entropy on the data's targets, added; 0 = off
  t.pipeline_microbatches = 0  # with mesh.stage > 1: microbatches streamed through the stages (>= stage); 0 = mesh.stage
  t.pipeline_repeats = 1  # with mesh.stage > 1: circular schedule, each microbatch visits every stage this many times
  t.pipeline_remat = False  # with mesh.stage > 1: recompute each stage visit in the backward pass (keep stage inputs only)
  t.xla_overlap = False  # TPU/GPU: XLA options overlapping collectives with compute (train.core.step.OVERLAP_OPTIONS)
  t.loss_scale = "auto"  # dynamic loss scaling: auto (on when model.dtype is float16) | dynamic | none
  t.loss_scale_init = 32768.0  # initial loss scale (2^15); halves on overflow, doubles after loss_scale_period finite steps
  t.loss_scale_period = 2000  # consecutive finite steps before the loss scale doubles
  t.mlm_rate = 0.15  # objective=mlm: fraction of text tokens selected for prediction (BERT)
  t.mlm_mask_fraction = 0.8  # objective=mlm: selected tokens replaced by the mask token
  t.mlm_random_fraction = 0.1  # objective=mlm: selected tokens replaced by a random token (the rest stay unchanged)
  t.profile_steps = ""  # "A:B": a jax.profiler trace of steps A..B-1 into WORKDIR/tensorboard (TensorBoard/Perfetto); "" = off
  t.compile_cache = "auto"  # persistent XLA compilation cache dir; auto = $XDG_CACHE_HOME or ~/.cache, then meshlm/xla; "" = off

  d = c.data = ml_collections.ConfigDict()
  d.sources = "builtin"  # builtin (Python's own docs + stdlib source) or a mixture spec; see data/sources.py
  d.weights = ()  # sampling weights per source (empty = the sources' own defaults)
  d.text_field = "text"  # JSONL / Parquet field holding the document text
  d.tokenizer = ""  # path to a sentencepiece .model; empty = train one into the run directory
  d.tokenizer_type = "bpe"  # bpe | unigram (when training one)
  d.tokenizer_vocab_size = 0  # 0 = model.vocab_size
  d.tokenizer_character_coverage = 0.9995  # fraction of characters given their own piece (rest: byte fallback)
  d.tokenizer_byte_fallback = True  # unknown characters become UTF-8 byte pieces, so any text round-trips
  d.tokenizer_max_sentences = 30_000  # cap on training lines (bounds tokenizer training time)
  d.packing = "first_fit"  # first_fit | concat (concatenate-then-split)
  d.packing_bins = 8  # first_fit: bins open at once per batch row (more = less padding, more reordering)
  d.shuffle_seed = 0  # seed of the global document order
  d.eval_fraction = 0.01  # documents held out for evaluation
  d.worker_count = 0  # grain worker processes (0 = in the main process, with a prefetch thread)
  d.prefetch = 2  # batches prefetched ahead of the step
  d.strict = False  # fail on unparseable records instead of skipping them with a warning
  d.chat_template = "auto"  # auto (an HF tokenizer's own Jinja template, else meshlm) | meshlm | path to a Jinja file
  d.chat_loss = "assistant"  # chat loss mask: assistant (assistant turns incl. end-of-turn) | all (every token)
  d.chat_truncation = "right"  # chats longer than seq_len: right (drop the end) | left (drop the start, keep last turns)
  d.fim_rate = 0.0  # fraction of training documents rearranged for fill-in-the-middle (data/fim.py); 0 = off
  d.fim_spm_rate = 0.5  # fraction of the FIM documents in suffix-prefix-middle order (the rest prefix-suffix-middle)
  d.fim_level = "char"  # FIM split points: char (uniform character positions, the paper's) | token (token boundaries)
  d.objective_mixture = ""  # UL2 denoiser weights, e.g. "R:0.4,X:0.4,S:0.2" (LM: plain causal); "" = off
  d.ul2_r_mean_span = 3.0  # objective_mixture R (regular) denoiser: mean corrupted span length in tokens
  d.ul2_r_rate = 0.15  # objective_mixture R denoiser: fraction of tokens corrupted
  d.ul2_x_mean_span = 32.0  # objective_mixture X (extreme) denoiser: mean corrupted span length in tokens
  d.ul2_x_rate = 0.5  # objective_mixture X denoiser: fraction of tokens corrupted

  ck = c.checkpoint = ml_collections.ConfigDict()
  ck.every = 500  # steps between checkpoints (and one at the end); 0 = only at the end
  ck.keep = 3  # most recent checkpoints kept
  ck.keep_period = 0  # also keep every N-th step permanently; 0 = off
  ck.async_save = True  # save in the background while training continues

  lg = c.log = ml_collections.ConfigDict()
  lg.tensorboard = True  # write TensorBoard event files under the workdir
  lg.wandb = False  # log to Weights & Biases (only when installed)
  lg.wandb_project = "meshlm"  # W&B project name
  lg.progress = True  # progress bar on the console

  ds = c.distributed = ml_collections.ConfigDict()
  ds.coordinator_address = ""  # host:port of process 0; empty = from the environment (TPU pod, SLURM) or single process
  ds.num_processes = 0  # 0 = from the environment
  ds.process_id = -1  # -1 = from the environment
  ds.local_device_ids = ()  # restrict this process to these local devices (empty = all)
  ds.mode = "auto"  # auto: start jax.distributed when the environment shows several processes | on | off
  ds.cpu_collectives = "gloo"  # cross-process collectives on CPU: gloo | mpi
  ds.timeout_s = 300  # seconds to wait for all processes to join

  rl = c.rl = ml_collections.ConfigDict()  # reinforcement learning (`python -m train.rl`, docs/post-training.md)
  rl.algorithm = "grpo"  # ppo | grpo | best_of_n (rejection-sampling fine-tuning) | gkd (on-policy distillation); sets train.objective ppo | grpo | sft | distill
  rl.reward = "py:data.tasks:reward"  # py:MODULE:FUNCTION (prompt, completion) -> float or dict of named parts (data.tasks.reward: correct + format) | rm:RUN (reward model)
  rl.env = ""  # multi-turn episodes (train/rl/env.py): builtin:calculator (a tool for data.tasks' prompts) | builtin:calculator_no_tool | py:MODULE:CLASS; "" = one completion per prompt scored by rl.reward
  rl.max_turns = 2  # with rl.env: most policy turns per episode
  rl.prompts = "builtin:arithmetic"  # JSONL file of prompts ({"prompt": ...} or {"messages": [...]}) | builtin:tasks | builtin:arithmetic | builtin:number_sorting | builtin:countdown | builtin:calculator (data/tasks.py) | builtin:greater
  rl.eval_fraction = 0.05  # share of the prompts held out for eval_reward_mean (chosen by a hash of the prompt text)
  rl.iterations = 100  # rollout iterations (best_of_n: rounds); also the checkpoint step
  rl.prompts_per_iteration = 16  # prompts sampled per iteration
  rl.samples_per_prompt = 4  # completions per prompt: GRPO's group size G, best_of_n's K (PPO: usually 1)
  rl.max_new_tokens = 16  # longest completion; prompt + completion must fit in train.seq_len + 1 tokens
  rl.engine = False  # rollouts through model.engine (continuous batching over a paged KV cache) instead of model.generate's static batch
  rl.temperature = 1.0  # sampling temperature; ppo/grpo's training forward pass uses the same (log-probs of logits / T); gkd's divergence uses train.distill_temperature
  rl.kl_coef = 0.05  # beta: PPO's per-token KL penalty in the reward, GRPO's k3 KL loss weight (0 = no reference)
  rl.kl_target = 0.0  # PPO adaptive KL controller target (KL per sequence, Ziegler et al. 2019); 0 = fixed kl_coef
  rl.kl_horizon = 10_000  # adaptive KL controller horizon in samples
  rl.gamma = 1.0  # PPO discount per token
  rl.lam = 0.95  # PPO GAE lambda
  rl.clip = 0.2  # policy ratio clip range epsilon (PPO and GRPO): the lower bound 1 - clip, and the upper unless clip_high is set
  rl.clip_high = 0.0  # DAPO's clip-higher: upper bound 1 + clip_high (e.g. 0.28 with clip 0.2); 0 = rl.clip
  rl.loss = "dapo"  # grpo: GRPO family aggregation (docs/post-training.md): grpo (per-sequence mean) | dr_grpo (sum / rollouts x max_new_tokens) | dapo (token mean over the batch) | gspo (sequence-level ratio)
  rl.scale_rewards = "auto"  # grpo: divide the centred rewards by the std of the group | batch | none (auto: none for dr_grpo, group otherwise)
  rl.dynamic_sampling = False  # grpo: DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts to refill the batch
  rl.dynamic_sampling_rounds = 4  # grpo with dynamic sampling: most sampling rounds per iteration; a batch still short is filled with zero-advantage groups (counted)
  rl.overlong_buffer = 0  # DAPO's soft overlong punishment over the last this-many tokens before rl.max_new_tokens (added to the reward); 0 = off
  rl.mask_truncated = False  # ppo / grpo: completions without a stop token get no loss (DAPO's overlong filtering)
  rl.value_clip = 0.2  # PPO value clip range around the rollout's values
  rl.vf_coef = 0.1  # PPO value-loss weight in the loss (the value head shares the policy trunk)
  rl.ent_coef = 0.0  # PPO entropy bonus weight
  rl.whiten_advantages = True  # PPO: advantages normalised to mean 0, std 1 over the rollout's completion tokens
  rl.epochs = 2  # passes over each rollout batch (minibatches of train.batch_size rows); best_of_n: SFT epochs per round
  rl.length_penalty = 0.0  # subtracted from the reward per completion token
  rl.missing_eos_penalty = 0.0  # subtracted from the reward of a completion that never produced a stop token
  rl.max_bad_rewards = 20  # halt once this many rewards raised or were non-finite (each such rollout is dropped)
  rl.eval_every = 5  # iterations between held-out evaluations (eval_reward_mean); 0 = off
  rl.eval_prompts = 64  # held-out prompts sampled (temperature rl.temperature, one each) per evaluation
  rl.ptx_coef = 0.0  # PPO-ptx: held-in conversations of data.sources' chat sources mixed into every update with this weight (Ouyang et al. 2022); 0 = off
  rl.async_rollouts = False  # ppo / grpo: a worker thread samples iteration i with the policy of iteration i - 1 - max_staleness while the learner trains (train/rl/async_rollouts.py)
  rl.max_staleness = 1  # with async_rollouts: how many iterations the sampler's policy may lag the learner's (0 = the synchronous loop's results)
  rl.rollout_devices = 0  # with async_rollouts: devices per process kept for sampling (their own mesh), the rest train; 0 = sample on the training devices
  rl.tis_cap = 3.0  # with async_rollouts: truncated importance weight cap C, w_t = min(exp(old_logp - sampler_logp), C) (TRL's default)
  rl.eval_best_of = 0  # also report eval_best_of_n_reward_mean: the best of this many samples per held-out prompt; 0 = off
  rl.seed = 0  # rollout RNG: iteration i samples with a seed derived from (seed, i), so a resumed run repeats it

  c.lock()
  return c
