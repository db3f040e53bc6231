"""Shared training code for the example scripts. Importing it, before diffusers, keeps the libraries' known
import-time noise off the console (`console`)."""

from .console import quiet_known_noise

quiet_known_noise()
