// pg-outbox console: the only script. Ticks or clears every row's box
// with the header's box on the dead-letter page.
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll('input[type="checkbox"][name="id"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
});
