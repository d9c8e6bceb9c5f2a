"""Vision-language support: the Qwen2-VL vision tower, its image inputs and the torchvision-free compat layer."""
