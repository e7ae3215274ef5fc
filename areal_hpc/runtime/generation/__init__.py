"""runtime/generation"""
