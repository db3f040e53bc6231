PYTHON ?= python3
LAUNCH = $(PYTHON) -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no
DEMO_DIR ?= demo-output
BENCH_DIR ?= build/bench

.PHONY: install demo test bench

# torch first: where none is installed, pin the release whose CPU build this project is tested with
# (an unpinned requirement would pull a multi-GB CUDA build on machines without a GPU).
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[test]"

# A real DreamBooth LoRA run, with EMA and validation: it teaches the pretrained tiny model (committed weights that
# draw the shape, colour and background a prompt names) an orange star it never saw, called "sks": one centred star,
# the UNet's LoRA only, learning rate 1e-2, half the pictures captioned with the empty prompt (without that, the
# pictures, drawn with classifier-free guidance, showed little of the star or its complementary colours). The
# learning tests train the same recipe (training_utils.testing.learning.star_lora_flags).
demo: install
	$(PYTHON) -m training_utils.testing.tiny --output_dir tiny sd_pretrained instance_star_demo
	rm -rf $(DEMO_DIR)
	$(LAUNCH) examples/dreambooth/train_dreambooth_lora.py \
	  --pretrained_model_name_or_path tiny/sd_pretrained --instance_data_dir tiny/instance_star_demo \
	  --instance_prompt "a sks star on a white background" --output_dir $(DEMO_DIR) \
	  --resolution 32 --center_crop --cache_latents --train_batch_size 4 --max_train_steps 200 \
	  --learning_rate 1e-2 --rank 8 --caption_dropout 0.5 --use_ema --ema_decay 0.95 \
	  --checkpointing_steps 100 --checkpoints_total_limit 1 \
	  --validation_prompt "a sks star on a white background" --num_validation_images 4 \
	  --validation_inference_steps 20 --validation_steps 25
	@echo "the star appearing, raw and EMA side by side after the base model's picture, step by step: $(DEMO_DIR)/validation/progress-p00.png"
	@echo "the model card, which shows it: $(DEMO_DIR)/README.md"

test: install
	$(PYTHON) -m pytest

# How close the LoRA script runs to the bare compute (step, validation, EMA, memory); not a test.
# Figures go to $(BENCH_DIR)/*.json and *.md.
bench:
	mkdir -p $(BENCH_DIR)
	$(PYTHON) -m tests.benchmarks.run --script text_to_image_lora --model tiny --json $(BENCH_DIR)/tiny.json
	$(PYTHON) -m tests.benchmarks.run --script text_to_image_lora --model wide --resolution 64 --batch_size 2 \
	  --steps 24 --validation_steps 8 --json $(BENCH_DIR)/wide.json
