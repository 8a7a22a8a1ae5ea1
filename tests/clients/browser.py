"""Headless Chromium for the browser tests: `chromium(*flags)` starts one through selenium and
chromedriver (Debian's packages); `speak` drives the page at `/` once."""

from __future__ import annotations

import shutil

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
MISSING = "needs chromium and chromedriver (apt-get install chromium chromium-driver)"
WAIT_S = 120  # a synthesis on the tiny preset, on a busy 2-core machine
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--autoplay-policy=no-user-gesture-required", "--mute-audio")


def chromium(*flags: str):
    """A headless Chromium driven by chromedriver, with `flags` beside the usual ones."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *flags):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def speak(browser, text: str, fmt: str, key: str | None = None) -> dict:
    """Fill the page's form, submit, wait for the status to settle: its state and data."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.wait import WebDriverWait

    if key is not None:
        field = browser.find_element(By.ID, "key")
        field.clear()
        field.send_keys(key)
    text_box = browser.find_element(By.ID, "text")
    text_box.clear()
    text_box.send_keys(text)
    Select(browser.find_element(By.ID, "format")).select_by_value(fmt)
    browser.find_element(By.ID, "speak").click()
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, WAIT_S).until(
        lambda _: status.get_attribute("data-state") in ("done", "error"))
    link = browser.find_element(By.ID, "download")
    return {"state": status.get_attribute("data-state"), "text": status.text,
            "bytes": int(status.get_attribute("data-bytes") or 0),
            "played": int(status.get_attribute("data-played") or 0),
            "href": link.get_attribute("href") or "", "file": link.get_attribute("download"),
            "player": browser.find_element(By.ID, "player").get_attribute("src") or ""}
