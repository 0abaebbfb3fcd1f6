// The console's only script: a learning curve drawn with Chart.js, a job page that follows its job, and a
// confirmation before a form that cannot be undone. Pages carry their data as JSON blocks, never as script.
"use strict";

// Training's own loss and every validation figure, one line each, by epoch.
function curveDatasets(points) {
  const keys = [];
  for (const p of points) {
    for (const k of Object.keys(p)) {
      if ((k === "train_loss" || k.startsWith("val_")) && !keys.includes(k)) keys.push(k);
    }
  }
  return keys.map((k) => ({ label: k, data: points.map((p) => ({ x: p.epoch, y: p[k] })), tension: 0 }));
}

function drawCurve(canvas, points) {
  return new Chart(canvas, {
    type: "line",
    data: { datasets: curveDatasets(points) },
    options: {
      animation: false, maintainAspectRatio: false, parsing: false,
      scales: { x: { type: "linear", title: { display: true, text: "epoch" }, ticks: { precision: 0 } } },
    },
  });
}

function showTraffic(table, point) {
  if (!table || !point) return;
  while (table.rows.length > 1) table.deleteRow(1);
  for (const k of Object.keys(point)) {
    if (!k.startsWith("bytes_")) continue;
    const name = k.slice("bytes_".length);
    const row = table.insertRow();
    row.className = "traffic-row";
    row.insertCell().textContent = name;
    row.insertCell().textContent = point[k].toLocaleString("en");
    row.insertCell().textContent = (point["round_trips_" + name] || 0).toLocaleString("en");
  }
}

// Poll the job every second; redraw the curve as epochs come; reload the page once the job has ended,
// which then shows its result.
function followJob(job) {
  const canvas = document.getElementById("curve");
  const chart = canvas ? drawCurve(canvas, job.curve) : null;
  if (canvas) canvas.dataset.epochs = job.curve.length;
  showTraffic(document.getElementById("traffic"), job.curve[job.curve.length - 1]);
  let ended = !["pending", "running"].includes(job.state);
  if (ended) return;
  const tick = async () => {
    let now;
    try {
      const response = await fetch("api/jobs/" + job.job_id, { credentials: "same-origin" });
      if (!response.ok) throw new Error(response.status);
      now = await response.json();
    } catch (e) {
      document.getElementById("progress").textContent = "the console lost the bank service; retrying";
      setTimeout(tick, 2000);
      return;
    }
    document.getElementById("bar").value = now.fraction || 0;
    document.getElementById("progress").textContent = now.progress;
    const state = document.getElementById("state");
    state.textContent = now.state;
    state.className = "state " + now.state;
    const events = document.getElementById("events");
    for (const e of now.events.slice(events.children.length)) {
      const li = document.createElement("li");
      li.textContent = e;
      events.appendChild(li);
    }
    if (chart && now.curve.length !== chart.data.datasets[0]?.data.length) {
      chart.data.datasets = curveDatasets(now.curve);
      chart.update();
      document.getElementById("curve").dataset.epochs = now.curve.length;
      showTraffic(document.getElementById("traffic"), now.curve[now.curve.length - 1]);
    }
    if (!["pending", "running"].includes(now.state)) {
      window.location.reload();
      return;
    }
    setTimeout(tick, 1000);
  };
  setTimeout(tick, 1000);
}

function dataOf(id) {
  const block = document.getElementById(id);
  return block ? JSON.parse(block.textContent) : null;
}

document.addEventListener("DOMContentLoaded", () => {
  const job = dataOf("job-data");
  if (job) followJob(job);
  const history = dataOf("history-data");
  if (history) drawCurve(document.getElementById("curve"), history);
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
});
