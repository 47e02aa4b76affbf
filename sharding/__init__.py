"""sharding"""
