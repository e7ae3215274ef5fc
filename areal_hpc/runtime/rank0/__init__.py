"""runtime/rank0"""
