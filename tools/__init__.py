"""Build tooling that stays in the checkout (never installed): tools/vllm_wheel.py builds dtp-layout-vllm."""
