// Headless Chromium (Debian's) through puppeteer-core: open each page URL given, wait for the page's
// window.result, print one JSON line per page. Usage: TOOLS=<dir> node drive.mjs <chromium> <url>...
import { createRequire } from "node:module";
import { join } from "node:path";

const puppeteer = createRequire(join(process.env.TOOLS, "package.json"))("puppeteer-core");
const [executablePath, ...urls] = process.argv.slice(2);
const browser = await puppeteer.launch({
  executablePath, headless: true, args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
try {
  for (const url of urls) {
    const page = await browser.newPage();
    const logs = [];
    page.on("console", (m) => logs.push(m.text()));
    page.on("pageerror", (e) => logs.push(String(e)));
    await page.goto(url);
    try {
      await page.waitForFunction(() => window.result !== undefined, { timeout: 60000, polling: 100 });
      console.log(JSON.stringify(await page.evaluate(() => window.result)));
    } catch (error) {
      console.log(JSON.stringify({ error: `no result: ${error}`, logs }));
    }
    await page.close();
  }
} finally {
  await browser.close();
}
